"""braid.comm.core: the bottom layer. The communicator (communicator.py) over the C++ extension and
its bootstrap (bootstrap.py: the store rendezvous, membership agreement, admission of joining
ranks), braid's group interface over a Communicator or any ProcessGroup (group.py) and its
split by host (group_carrier.py), the torch.distributed backend "braid" (backend.py), and the
small parts below them: errors, work handles, wire statistics, the vocabulary of ops and dtypes,
host identity, the launcher's environment, the compression kernels per device. Nothing here
imports the layers above (compression, ddp, zero, fsdp2, tp, cp, moe).
"""
