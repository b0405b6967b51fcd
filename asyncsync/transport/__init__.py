"""How versions travel from the trainer. The fleet of one sender's servers (``fleet``): what each server
holds, changed only by named transitions (``book``), the epochs of data-plane groups over them
(``epochs``, each group per receiver protocol: ``topology``; relay trees and their policy: ``relay``).
One version as a pipeline of values (``send``: announce, deliver, record, repair), its HTTP phases
(``phases``), its kinds (``kinds``: weights, adapters), its broadcasts on each rank (``datapath``),
where each bucket's bytes come from (``sources``), what rank 0 tells the other ranks (``commands``,
``follower``), shared memory for same-host servers (``shm``) and adapter loads (``adapters``). The HTTP
pool they speak through is ``asyncsync.control``, a layer below."""
