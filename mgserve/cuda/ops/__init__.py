"""The op families of the device backend, one family (or one side of one) per module.

Each family is a pair of classes with the same methods:

- ``<Family>Torch``: plain PyTorch on whatever device the tensors live on, calling
  ``mgserve.core.reference`` wherever the math is the same. It runs on the CPU in CI (checked
  against the reference) and is the fallback on a GPU; wherever a decode step uses it, it is
  written with static shapes and no host synchronisation, so the step captures into a CUDA graph.
- ``<Family>Cuda``: the same methods launching NVRTC kernels through the backend's shared
  ``Kernels`` on torch's current stream; it holds an explicit ``fallback`` (the torch family) that
  it calls for inputs no kernel covers.

Families that need another family (QSA decode runs the attention kernel; the prompt-size HC mix
runs the linear and norm ops) are given it when the backend is built (``mgserve.cuda.backend``).
"""
