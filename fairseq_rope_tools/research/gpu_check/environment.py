"""fairseq-rope-gpu-check, section 1: the environment (GPU, CUDA, torch, Triton, CTranslate2, fairseq)."""

import platform

from fairseq_rope_tools.research.machine import cpu_model


def distribution_version(*names):
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return None



def environment_section(device):
    import torch

    info = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": distribution_version("triton"),
            "ctranslate2": distribution_version("ctranslate2"),
            "fairseq": distribution_version("fairseq-fixed", "fairseq"),
            "cpu": cpu_model() or platform.processor() or "unknown"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "memory_gib": round(props.total_memory / 2 ** 30, 1), "visible_gpus": torch.cuda.device_count()}
        import ctranslate2

        info["ctranslate2_cuda_devices"] = ctranslate2.get_cuda_device_count()
    return info

