"""Everything a receiver needs, and nothing else: this package imports only torch and the standard
library (the ``crc32c`` package, a C extension with no dependencies, at the first host checksum).

An inference server that receives asyncsync's versions (the reference server, asyncsync's vLLM
backend, a new engine's receiver) imports from here and never loads the trainer's stack (aiohttp,
prometheus_client, the sync worker)::

    specs      TensorSpec, Bucket, BucketPlan, dtype names, typed views into flat buffers
    schema     the vocabulary messages are declared in, and the one reader that decodes them
    wire       the control messages: GroupSpec, BucketMeta, UpdateRequest, VersionRequest, InitGroupRequest
    tags       UPDATE_INFO: the messages vLLM's update_info carries, told apart by tag
    sglang     SGLang's weight-update messages and its flattened-bucket layout
    checksum   CRC32C of a bucket, on the host or on the buffer's own device
    group      DataPlaneGroup: join the trainer's process group (gloo or NCCL) and receive broadcasts
    stream     StreamEdge: a relay edge of host weights, an authenticated TCP stream read with bounded reads
    keys       the data plane's keys: sealed rendezvous values, proofs of the key, vLLM's payload credential
    frames     FrameHeader: the fixed-size header that agrees each payload's length before it moves (and its MAC)
    stager     BucketStager: receive a version into flat buffers and verify it before anything is applied,
               the parts below wired together once
    staging    StagingBuffers: where versions land, and what of them the live weights alias
    joined     JoinedGroups: the trainer's groups and the relay edges a receiver joined, left together
    intake     the three ways in: a whole version off the wire, from shared memory, bucket by bucket

Import the submodules directly; this ``__init__`` imports none of them.
"""
