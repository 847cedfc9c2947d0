"""XLA_FLAGS for a test's subprocess that needs N fake CPU devices, keeping the run's own flags (conftest's
compile-speed setting) instead of replacing them."""
import os


def device_flags(n: int) -> str:
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
