"""How versions travel from the trainer: the data-plane groups per receiver protocol (``topology``),
which servers are in them (``membership``), sending one version in named phases (``send``) and its
broadcasts on each rank (``datapath``), where each bucket's bytes come from (``sources``), what rank 0
tells the other ranks (``commands``, ``follower``), shared memory for same-host servers (``shm``) and
adapter loads (``adapters``). The HTTP pool they speak through is ``asyncsync.control``, a layer below."""
