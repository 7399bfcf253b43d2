"""The engine actors' allocator (actors/allocator.py): tcmalloc preloaded where the machine has
it, the system's malloc otherwise or when asked, a clear refusal for `tcmalloc` where it is
missing; and an actor started with the engine actors' Ray arguments really runs on it."""

from __future__ import annotations

import pytest

from actors import allocator
from actors.allocator import find_tcmalloc, preload_env
from pipeline.config import ComputeConfig
from pipeline.stages.engine_actor import engine_actor_args


def test_auto_and_tcmalloc_preload_it_after_what_is_preloaded(monkeypatch) -> None:  # noqa: ANN001
    if find_tcmalloc() is None:
        pytest.skip("this machine has no libtcmalloc_minimal (apt install libtcmalloc-minimal4)")
    library = find_tcmalloc()
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert preload_env("auto") == preload_env("tcmalloc") == {"LD_PRELOAD": library}
    monkeypatch.setenv("LD_PRELOAD", f"libmine.so:{library}")
    assert preload_env("auto") == {"LD_PRELOAD": f"{library}:libmine.so"}
    assert preload_env("system") == {}


def test_a_machine_without_it_runs_on_the_system_allocator_or_refuses_by_name(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(allocator, "_LIBRARY", "raypack_no_such_allocator")  # looked up for real
    assert find_tcmalloc() is None
    assert preload_env("auto") == {}
    with pytest.raises(ValueError, match=r"--allocator tcmalloc: .*\(apt install"):
        preload_env("tcmalloc")
    with pytest.raises(ValueError, match="allocator must be one of"):
        ComputeConfig(allocator="jemalloc")


@pytest.mark.timeout(120)
def test_an_engine_actor_process_runs_on_tcmalloc(ray_cluster) -> None:  # noqa: ANN001
    """An actor with the engine actors' Ray arguments (resources, restarts, runtime_env), and
    the actors it starts (a tp x pp engine's workers), have tcmalloc mapped; with `system`,
    not."""
    import ray

    if find_tcmalloc() is None:
        pytest.skip("this machine has no libtcmalloc_minimal (apt install libtcmalloc-minimal4)")

    class Probe:
        def mapped(self) -> bool:
            with open("/proc/self/maps") as maps:
                return any("tcmalloc" in line for line in maps)

        def child_mapped(self) -> bool:
            child = ray.remote(num_cpus=0)(Probe).remote()
            return bool(ray.get(child.mapped.remote()))

    for setting, expected in (("auto", True), ("system", False)):
        compute = ComputeConfig(num_cpus_per_actor=0.1, allocator=setting)
        probe = ray.remote(**engine_actor_args(compute))(Probe).remote()
        assert ray.get(probe.mapped.remote()) is expected, setting
        assert ray.get(probe.child_mapped.remote()) is expected, setting
        ray.kill(probe)
