"""The layer pipeline over several GPUs (issue 14): its plan, its performance model, and its
runtime (a model's stages through a transport; decode steps in micro-batches of sessions).

costs.py      per layer: weight bytes read and FLOPs per step, per-session bytes at depth
stages.py     the stage plan: contiguous layer ranges per GPU, by memory and balance
report.py     the stage plan as ``mgserve info --plan`` prints it
perfmodel.py  prefill and decode throughput of a pipeline from stage times and links
gpumodel.py   stage times and PCIe links of a GPU we do not have (a roofline)
staged.py     a device model run as stages (StagedLM); --virtual-stages
micro.py      a decode step's sessions as micro-batches in flight through the stages
timing.py     per-stage figures: busy, bubbles, overlap, link bytes and seconds
stage_stats.py  the per-stage figures across processes, gathered on rank 0
transport.py  the hand-off between stages: LocalTransport (one process), LinkThrottle
transport_dist.py  DistTransport: stages in other processes (torch.distributed), sends in
              flight while the sender goes on
rendezvous.py where a pipeline's processes meet (--dist-*, torchrun's variables)
lockstep.py   serve across processes: rank 0 broadcasts each step, the other ranks follow
slots_dist.py slot save / restore across processes: each rank's part, one file on rank 0
launch.py     serve --device-list: rank 0 starts a pipeline of this host's GPUs, a process each
"""
