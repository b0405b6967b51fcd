"""How versions travel from the trainer: the control plane (``control``: pooled HTTP on an asyncio
loop), the data-plane groups per receiver protocol (``topology``), which servers are in them
(``membership``) and sending one version (``send``)."""
