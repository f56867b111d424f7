"""pdgpu.host: glibc told to keep freed memory, once; silently nothing elsewhere."""

from __future__ import annotations

import platform

from pdgpu import host


def test_keep_freed_memory_is_accepted_on_glibc_and_applied_once():
    """glibc accepts both thresholds; a second call returns the first result unchanged."""
    applied = host.keep_freed_memory()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert applied == {"trim_threshold": True, "mmap_threshold": True}
    else:
        assert applied == {}
    assert host.keep_freed_memory() is applied
