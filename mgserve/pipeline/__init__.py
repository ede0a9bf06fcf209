"""The layer pipeline over several GPUs (issue 14): its plan and its performance model.

costs.py      per layer: weight bytes read and FLOPs per step, per-session bytes at depth
stages.py     the stage plan: contiguous layer ranges per GPU, by memory and balance
report.py     the stage plan as ``mgserve info --plan`` prints it
perfmodel.py  prefill and decode throughput of a pipeline from stage times and links
gpumodel.py   stage times and PCIe links of a GPU we do not have (a roofline)
"""
