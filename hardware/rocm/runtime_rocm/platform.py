"""The ROCm platform: AMD GPUs, which a HIP build of torch exposes as ``torch.cuda``.

Everything but the names is the shared :class:`runtime.platforms.gpu.GpuPlatform`:
detection counts devices through amdsmi (torch's ``_device_count_amdsmi``, which honours
``HIP_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``) without starting HIP, or in a
short-lived child process without amdsmi; ``device()`` in the worker starts HIP.
"""

from __future__ import annotations

from runtime.platforms.gpu import GpuPlatform


class RocmPlatform(GpuPlatform):
    name = "rocm"
    device_type = "cuda"  # HIP builds of torch keep the "cuda" device type and torch.cuda
    dist_backend = "nccl"  # torch.distributed runs "nccl" on RCCL in HIP builds
    priority = 10  # as cuda (a torch build is CUDA or HIP, never both); above cpu
    label = "ROCm"
    torch_build = "hip"
    count_hook = "_device_count_amdsmi"
    visible_devices_envs = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
