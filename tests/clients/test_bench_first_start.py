"""bench_first_start: the cache a first start gets, and the report's reading of its samples."""

from __future__ import annotations

from pathlib import Path

from dualserve.clients.bench_first_start import FirstStart, Sample, prompt, report, temporary_cache


def test_temporary_cache_links_only_the_downloads_and_what_is_kept(tmp_path: Path):
    real = tmp_path / "real"
    for name in ("models", "converted", "kernels", "compile"):
        (real / name).mkdir(parents=True)
    cache = temporary_cache(real, ["kernels"])
    try:
        assert sorted(p.name for p in cache.iterdir()) == ["kernels", "models"]
        assert (cache / "models").resolve() == (real / "models").resolve()
    finally:
        for p in cache.iterdir():
            p.unlink()
        cache.rmdir()


def test_prompts_differ():
    assert len({prompt(i) for i in range(40)}) == 40


def test_report_reads_when_every_later_sample_is_within_reach():
    eager, compiled = 70.0, 150.0
    samples = [Sample(10, "ar", 64, eager, 0, 5), Sample(40, "ar", 64, 145.0, 1, 5),   # a lucky sample
               Sample(70, "ar", 64, eager, 1, 5), Sample(100, "ar", 64, 140.0, 3, 5),
               Sample(130, "ar", 64, compiled, None, None), Sample(135, "ar", 64, 152.0, None, None),
               Sample(140, "ar", 64, 149.0, None, None)]
    lines = report(FirstStart(ready_s=8.0, compiled_s=128.0, samples=samples), ["ar", "eagle"], within=0.9)
    assert lines[0] == "ready (/health) after 8.0 s; every graph built by 128 s"
    assert lines[1] == "ar: compiled speed 150.0 tok/s; every sample >= 90% of it from 100 s after the start"
    assert lines[2] == "eagle: no sample after the last graph was built"
