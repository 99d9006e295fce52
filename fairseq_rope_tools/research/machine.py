"""The machine a benchmark runs on: what its CPU is called, this process's memory counters, and
glibc's allocator settings.

Standard library only, so that any script can describe its machine without importing torch.
"""

import os
import platform
import resource
import subprocess
import sys

# --malloc retain: every allocation from the heap (no mmap), freed memory never trimmed
RETAIN_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


def use_malloc(mode, argv=None):
    """``--malloc retain``: restart this script (``argv``, default ``sys.argv``) under
    RETAIN_TUNABLES, which glibc reads only at process start; a no-op for ``default`` or once
    restarted."""
    if mode == "retain" and os.environ.get("GLIBC_TUNABLES") != RETAIN_TUNABLES:
        argv = sys.argv if argv is None else argv
        os.execve(sys.executable, [sys.executable, *argv], dict(os.environ, GLIBC_TUNABLES=RETAIN_TUNABLES))


def page_faults():
    """Minor page faults of this process so far: memory the allocator took fresh from the OS."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def status_kib(field):
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``...), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_resident_kib():
    """The resident-set high-water mark of this process."""
    return status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cpu_model():
    """The CPU's model name: /proc/cpuinfo's ``model name``, else lscpu's ``Model name`` (which
    also knows ARM cores); None when neither says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def describe_cpu():
    """``device`` and ``cpus`` of a benchmark report run on the CPU."""
    return {"device": cpu_model() or platform.processor() or "cpu", "cpus": os.cpu_count()}
