"""`zero-kernels tune`: the report of a real run on gloo (every trial measured, predictions
labelled, the recommendation the fastest fitting trial), a memory limit that excludes some or all
configurations, bad arguments, and the pure parts (prediction, grid, peak memory)."""

import contextlib
import io
import json
import os
import sys

import pytest
import torch
from dist_utils import stop_forkserver
from torch import nn

from zero_kernels.cli import tune_plan
from zero_kernels.cli.main import main
from zero_kernels.cli.tune_plan import Measured, TrialConfig

FAST = ["--nproc", "2", "--steps", "2", "--warmup", "1", "--no-progress", "--overlap", "off"]


@pytest.fixture(scope="module", autouse=True)
def _fixed_mmap_threshold():
    """The trials' ranks (forked from a server started by this module's first run) get glibc's
    mmap threshold fixed: with its default dynamic threshold the peak RSS of the same trial
    moved by up to 3 bytes/param between runs (stage 2 on big_mlp: 11.6-14.5, once above the
    15.9 limit below), with it by 0.02 (10.63-10.65; docs/benchmarks.md, "The host block
    cache"). tune's server is its own: one the tests' ranks started (tests/dist_utils.py) is
    stopped first, and tune's is stopped at the end."""
    import os

    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    stop_forkserver()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    yield
    stop_forkserver()
    if old is None:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = old


BIG_PSI = 32 * (512 * 512 + 512)  # big_mlp's parameters


def big_mlp() -> nn.Module:
    """8.4M fp32 params (34 MB) in 1 MB matrices: model states dominate the runtime's own
    memory, and 1 MiB buckets stay small (a bucket holds at least a whole parameter)."""
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(32)])


def _run(out, *args) -> tuple[int, str, str]:
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = main(["tune", *FAST, "--out", str(out), *args])
    return rc, so.getvalue(), se.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    args = ["--model-size", "tiny", "--stages", "1,2", "--buckets", "1", "--repeats", "2"]
    rc, stdout, stderr = _run(out, *args, "--reduce-dtypes", "fp32,bf16")
    return rc, stdout, stderr, out


def _fits_and_fastest(res: dict) -> dict:
    fit = [
        t
        for t in res["trials"]
        if t["status"] == "measured" and t["fits"] and not t["config"]["ddp"]
    ]
    return min(fit, key=lambda t: t["measured"]["step_time_s"])


@pytest.mark.distributed
def test_report_of_a_real_run(tiny_run):
    rc, stdout, stderr, out = tiny_run
    assert rc == 0, stderr
    res = json.loads((out / "tune.json").read_text())
    assert res["world_size"] == 2 and res["model"]["n_params"] > 100_000
    assert {"torch", "python", "platform", "cores"} <= set(res["machine"])
    assert res["command"].startswith("zero-kernels tune")
    # the grid: DDP, stage 1 (fp32 only: stage 1 refuses bf16), stage 2 in fp32 and bf16
    labels = sorted(t["config"]["label"] for t in res["trials"])
    assert labels == sorted(
        [
            "DDP + AdamW(fused=True)",
            "stage 1, bucket 1 MiB, fp32 reduce",
            "stage 2, bucket 1 MiB, fp32 reduce",
            "stage 2, bucket 1 MiB, bf16 reduce",
        ]
    ), labels
    for t in res["trials"]:
        assert t["status"] == "measured", t
        m, p = t["measured"], t["predicted"]
        assert m["step_time_s"] > 0 and len(m["step_time_s_per_rank"]) == 2
        # --repeats 2: two rounds, each the slower rank's median; the median of the two
        assert len(m["step_time_s_per_run"]) == 2 and len(m["peak_rss_bytes_per_run"]) == 2
        assert m["step_time_s_per_run"][0] == max(m["step_time_s_per_rank"])  # slower rank
        assert m["step_time_s"] == pytest.approx(sum(m["step_time_s_per_run"]) / 2)
        assert m["peak_rss_bytes"] == max(m["peak_rss_bytes_per_run"])
        assert all(len(s) == 2 for s in m["step_times_s_per_rank"])  # --steps 2 timed
        assert len(m["peak_rss_bytes_per_rank"]) == 2 and min(m["peak_rss_bytes_per_rank"]) > 0
        assert m["what"].startswith("measured") and p["what"].startswith("prediction")
        assert p["memory"]["what"].startswith("prediction")
        assert p["step_time_s"] >= p["compute_s"] > 0 and p["memory"]["total_bytes"] > 0
        assert t["ratio_measured_to_predicted"] == pytest.approx(
            m["step_time_s"] / p["step_time_s"]
        )
        assert t["fits"] == (m["peak_rss_bytes"] <= res["mem_limit_bytes"])
    # every stage's model states are in the peak: at least params + grads + state shards
    psi = res["model"]["n_params"]
    for t in res["trials"]:
        assert t["measured"]["peak_rss_bytes"] > 8 * psi, t["config"]["label"]
    best = _fits_and_fastest(res)
    rec = res["recommendation"]
    assert res["trials"][rec["index"]] is not None
    assert rec["label"] == best["config"]["label"]
    assert rec["step_time_s"] == best["measured"]["step_time_s"]
    assert rec["policy_options"]["stage"] == best["config"]["stage"]
    # bandwidth: reduce-scatter and all-gather per algorithm (no ring at 2 ranks; shm where the
    # ranks share the host, as here), all-reduce
    seen = {(r["op"], r["algorithm"]) for r in res["bandwidth"]}
    assert seen == {
        ("reduce_scatter", "native"),
        ("reduce_scatter", "pairwise"),
        ("reduce_scatter", "shm"),
        ("all_gather", "native"),
        ("all_gather", "pairwise"),
        ("all_gather", "shm"),
        ("all_reduce", "native"),
    }
    assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in res["bandwidth"])
    sizes = {r["bytes"] for r in res["bandwidth"]}
    assert max(sizes) == pytest.approx(4 * psi, rel=0.01)  # capped by the model's grads
    assert res["compute"]["fwd_bwd_s"] > 0 and res["compute"]["activation_bytes"] > 0
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # the printed table and recommendation
    assert "collective time, measured" in stdout and "predicted" in stdout
    assert f"recommended: {rec['label']}" in stdout
    assert (
        "zero_kernels.ZeroOptimizer(model, torch.optim.AdamW, policy=ZeroPolicy.resolve(stage="
        in stdout
    )
    if best["config"]["reduce_dtype"] == "bf16":
        assert "reduce_dtype=torch.bfloat16" in stdout
    for t in res["trials"]:
        assert t["config"]["label"] in stdout


def test_recommended_arguments_are_policy_options():
    from zero_kernels.policy import ZeroPolicy

    configs = tune_plan.grid((1, 2, 3), (1.0, 4.0), (1, 2), ("fp32", "bf16"), (False, True), True)
    for c in configs:
        if c.stage:
            kw = c.policy_options()
            if "reduce_dtype" in kw:
                kw["reduce_dtype"] = torch.bfloat16
            assert ZeroPolicy.resolve(**kw).stage == c.stage, c


@pytest.mark.distributed
def test_mem_limit_excludes_some_and_recommends_among_the_rest(tmp_path):
    # DDP holds 16 bytes per param (params, grads, AdamW's two moments) and is predicted at
    # 16.1: 15.9 excludes it by prediction; stage 2 holds 4 + 12/2 = 10 per param (measured
    # 10.6 here with the fixed mmap threshold, the runtime's own memory included) and fits
    limit = int(15.9 * BIG_PSI)
    rc, stdout, stderr = _run(
        tmp_path / "out",
        "--model",
        "test_cli_tune:big_mlp",
        "--stages",
        "1,2",
        "--buckets",
        "1",
        "--reduce-dtypes",
        "fp32",
        "--mem-limit",
        f"{limit}B",
    )
    assert rc == 0, stderr
    res = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert res["model"]["n_params"] == BIG_PSI and res["mem_limit_bytes"] == limit
    by = {t["config"]["label"]: t for t in res["trials"]}
    ddp = by["DDP + AdamW(fused=True)"]
    assert ddp["status"] == "over_limit" and ddp["fits"] is False and ddp["measured"] is None
    assert ddp["why"].startswith("over limit (predicted ")
    assert ddp["predicted"]["memory"]["total_bytes"] > limit
    measured = [t for t in res["trials"] if t["status"] == "measured"]
    assert measured and all(not t["config"]["ddp"] for t in measured)
    for t in measured:
        assert t["fits"] == (t["measured"]["peak_rss_bytes"] <= limit)
    s2 = by["stage 2, bucket 1 MiB, fp32 reduce"]
    assert s2["fits"], s2["measured"]
    best = _fits_and_fastest(res)
    assert res["recommendation"]["label"] == best["config"]["label"]
    assert best["measured"]["peak_rss_bytes"] <= limit
    assert "over limit (predicted" in stdout


@pytest.mark.distributed
def test_limit_that_excludes_everything_exits_1(tmp_path):
    rc, stdout, stderr = _run(
        tmp_path / "out", "--model-size", "tiny", "--stages", "2", "--mem-limit", "50kB"
    )
    assert rc == 1
    assert "no ZeRO configuration fits 50 kB per rank" in stderr, stderr
    assert "no configuration fits" in stdout and "the smallest predicted is stage 2" in stdout
    res = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert res["recommendation"] is None
    assert all(t["status"] == "over_limit" for t in res["trials"])
    assert res["smallest_predicted"]["label"].startswith("stage 2")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--nproc", "0"], "--nproc"),
        (["--nproc", "100000"], "--nproc"),
        (["--threads", "100000"], "--threads"),
        (["--mem-limit", "abc"], "--mem-limit"),
        (["--mem-limit=-2GB"], "--mem-limit"),
        (["--mem-limit", "0"], "--mem-limit"),
        (["--model", "no_such_module_zk:factory"], "--model"),
        (["--model", "torch.nn:Linear"], "--model"),
        (["--model", "/nonexistent/config.json"], "--model"),
        (["--model-size", "huge"], "--model-size"),
        (["--model-size", "tiny", "--model", "a:b"], "--model"),
        (["--stages", "4"], "--stages"),
        (["--buckets", "0"], "--buckets"),
        (["--prefetch", "x"], "--prefetch"),
        (["--overlap", "maybe"], "--overlap"),
        (["--reduce-dtypes", "fp8"], "--reduce-dtypes"),
        (["--steps", "0"], "--steps"),
        (["--time-budget", "-1"], "--time-budget"),
    ],
)
def test_bad_arguments_one_line_exit_2(argv, needle, capsys, tmp_path):
    assert main(["tune", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zero-kernels: error:") and needle in err[0], err
    assert not (tmp_path / "o").exists()  # nothing created before the arguments are good


def test_out_not_writable(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["tune", "--model-size", "tiny", "--out", str(f / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and str(f / "sub") in err[0], err


def test_plain_progress_line_without_tqdm(monkeypatch, capsys):
    from zero_kernels.cli.tune import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    bar = Progress(3, True)
    assert bar.bar is None
    bar.show("stage 2, bucket 1 MiB")
    bar.advance()
    bar.close()
    err = capsys.readouterr().err
    assert "\rtune: 0/3 stage 2, bucket 1 MiB" in err and "tune: 1/3 done" in err


# ---- pure parts -------------------------------------------------------------------------------


def _measured(**kw) -> Measured:
    pts = ((1 << 20, 0.002), (8 << 20, 0.010))
    bw = {
        ("reduce_scatter", "native"): pts,
        ("reduce_scatter", "pairwise"): tuple((b, t / 2) for b, t in pts),
        ("all_gather", "native"): pts,
        ("all_gather", "pairwise"): tuple((b, t * 0.95) for b, t in pts),
        ("all_reduce", "native"): tuple((b, 2 * t) for b, t in pts),
    }
    base = dict(
        world_size=2,
        bandwidth=bw,
        fwd_bwd_s=0.1,
        optimizer_full_s=0.01,
        optimizer_shard_s=0.005,
        activation_bytes=1e6,
        overlap=0.0,
    )
    return Measured(**{**base, **kw})


def test_collective_time_interpolates_and_extrapolates():
    pts = ((1000, 1.0), (3000, 2.0))
    assert tune_plan.collective_time(pts, 10) == 1.0  # latency floor
    assert tune_plan.collective_time(pts, 2000) == pytest.approx(1.5)
    assert tune_plan.collective_time(pts, 6000) == pytest.approx(4.0)  # at the top bandwidth


def test_algorithm_choice_follows_comm_margin():
    m = _measured()
    assert tune_plan.pick_algorithm(m.bandwidth, "reduce_scatter", 4 << 20)[0] == "pairwise"
    # 0.95x native is inside comm's 10% margin: native
    assert tune_plan.pick_algorithm(m.bandwidth, "all_gather", 4 << 20)[0] == "native"


def test_prediction_follows_the_volumes():
    from zero_kernels.cli.tune_model import ModelFacts

    facts = ModelFacts(
        n_params=4 << 20,
        shapes=((256, 256),) * 64,
        unit_numels=(1 << 18,) * 16,
        root_numel=0,
        input="",
    )
    m = _measured()
    p = {
        c: tune_plan.predict_time(c, facts, m)
        for c in (
            TrialConfig(1, 4.0),
            TrialConfig(2, 4.0),
            TrialConfig(2, 4.0, "bf16"),
            TrialConfig(3, None, "fp32", 1),
        )
    }
    s1, s2, s2b, s3 = p.values()
    assert s1["comm_s"] == pytest.approx(s2["comm_s"])  # 2Ψ both
    assert s2b["comm_s"] < s2["comm_s"]  # half the gradient bytes
    assert s3["comm_s"] > s2["comm_s"]  # 3Ψ
    for v in p.values():  # nothing hidden with overlap efficiency 0
        assert v["exposed_comm_s"] == pytest.approx(v["comm_s"])
        assert v["step_time_s"] == pytest.approx(0.1 + 0.005 + v["comm_s"])
    hidden = tune_plan.predict_time(TrialConfig(2, 4.0), facts, _measured(overlap=1.0))
    assert hidden["exposed_comm_s"] < s2["exposed_comm_s"]
    mem = [
        tune_plan.predict_memory(c, facts, m)["total_bytes"]
        for c in (TrialConfig(1, 1.0), TrialConfig(2, 1.0), TrialConfig(3, None, "fp32", 1))
    ]
    assert mem[0] > mem[1] > mem[2]  # stage 1 > stage 2 > stage 3 per rank
    # stage 2's buffers: its two largest buckets (1 MiB here), half of them with bf16
    s2 = tune_plan.predict_memory(TrialConfig(2, 1.0), facts, m)["comm_buffer_bytes"]
    assert s2 == pytest.approx(2 * 2**20, rel=0.01)
    bf16 = tune_plan.predict_memory(TrialConfig(2, 1.0, "bf16"), facts, m)["comm_buffer_bytes"]
    assert bf16 == s2 / 2
    # stage 3 gathers the root unit, the running unit and `prefetch` more; a model without
    # repeated blocks is all root: gathered whole
    s3 = tune_plan.predict_memory(TrialConfig(3, None, "fp32", 2), facts, m)
    assert s3["live_bytes"] == 4 * 3 * (1 << 18)
    flat = ModelFacts(facts.n_params, facts.shapes, (), facts.n_params, "")
    s3 = tune_plan.predict_memory(TrialConfig(3, None, "fp32", 1), flat, m)
    assert s3["live_bytes"] == 4 * facts.n_params
    assert tune_plan.predict_memory(TrialConfig(0, 25.0), facts, m)["total_bytes"] > mem[0]


def test_grid_and_defaults():
    g = tune_plan.grid((1, 2, 3), (1.0,), (1, 2), ("fp32", "bf16"), (False, True), True)
    assert g[0].stage == 0
    assert not [c for c in g if c.stage == 1 and c.reduce_dtype == "bf16"]
    assert not [c for c in g if c.stage == 3 and c.overlap_param_gather]
    assert len(g) == 1 + 2 + 4 + 4
    assert tune_plan.default_buckets(100_000) == (1.0,)
    assert tune_plan.default_buckets(840_000) == (1.0, 4.0)
    assert tune_plan.default_buckets(100_000_000) == (4.0, 25.0, 100.0)
    assert tune_plan.overlap_efficiency(2, 2, 1) == 0.0
    assert tune_plan.overlap_efficiency(8, 2, 1) == 1.0


def test_peak_rss_sees_an_allocation():
    """A fresh 40 MB tensor raises the peak by its size. The host block cache is off for the
    measurement: an earlier test in this process may have left a block of that size in it, and
    serving the tensor from pages already resident is what the cache is for (the tune trials
    measure with it as the run uses it)."""
    from zero_kernels import hostmem
    from zero_kernels.cli.tune_worker import PeakRSS

    was = hostmem.installed()
    hostmem.disable()
    try:
        t = PeakRSS()
        assert t.hwm_reset  # Linux's clear_refs works here; tune.json says so where it does not
        x = torch.ones(10_000_000)  # 40 MB, touched
        del x
        assert 38e6 < t.peak() < 60e6, t.peak()
    finally:
        if was:
            hostmem.install()


def test_state_dtypes_in_the_grid_and_predictions():
    """--state-dtypes: each ZeRO configuration once per state dtype (DDP once); the moments'
    bytes shrink the predicted memory by (8 - 2 - 8/256) bytes per param / N at int8, the
    predicted step by the bytes it moves (16 of 28); the recommendation names state_dtype."""
    from zero_kernels.cli.tune_model import ModelFacts

    g1 = tune_plan.grid((2, 3), (4.0,), (1,), ("fp32",), (False,), True)
    g2 = tune_plan.grid((2, 3), (4.0,), (1,), ("fp32",), (False,), True, ("fp32", "int8"))
    assert len(g2) == 2 * len(g1) - 1 and sum(c.stage == 0 for c in g2) == 1
    facts = ModelFacts(4 << 20, ((256, 256),) * 64, (1 << 18,) * 16, 0, "")
    m = _measured()
    for stage in (2, 3):
        a = TrialConfig(stage, 4.0 if stage == 2 else None, "fp32", 1 if stage == 3 else None)
        b = TrialConfig(
            *[getattr(a, f) for f in ("stage", "bucket_mb", "reduce_dtype")],
            a.prefetch,
            False,
            "int8",
        )
        saved = (
            tune_plan.predict_memory(a, facts, m)["model_state_bytes"]
            - tune_plan.predict_memory(b, facts, m)["model_state_bytes"]
        )
        assert saved == pytest.approx((8 - 2 - 8 / 256) * facts.n_params / 2)
        ta = tune_plan.predict_time(a, facts, m)["optimizer_s"]
        assert tune_plan.predict_time(b, facts, m)["optimizer_s"] == pytest.approx(ta * 16 / 28)
        assert b.policy_options()["state_dtype"] == "int8" and "int8 state" in b.label
        # where the probe timed the low-bit step, its time (an arithmetic-bound CPU: slower)
        mm = _measured(optimizer_shard_s_by_dtype={"fp32": 0.005, "int8": 0.008})
        assert tune_plan.predict_time(b, facts, mm)["optimizer_s"] == 0.008


def test_offload_in_the_grid_and_predictions():
    """--offload: each ZeRO configuration once per tier ("both" at stage 3 only); an offload
    trial's kwargs are ZeroOptimizer's (nvme tiers, the folder); its predicted memory drops by
    the moments (and with params, the shards), its step grows by the disk's I/O time."""
    from zero_kernels.cli.tune_model import ModelFacts

    g = tune_plan.grid(
        (2, 3),
        (4.0,),
        (1,),
        ("fp32",),
        (False,),
        True,
        ("fp32",),
        ("none", "optimizer", "both"),
        "/tmp/zk-off",
    )
    assert [(c.stage, c.offload) for c in g] == [
        (0, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer"), (3, "both"),
    ]  # fmt: skip
    both = g[-1]
    assert both.policy_options() == {
        "stage": 3,
        "prefetch": 1,
        "offload_optimizer": "nvme",
        "offload_params": "nvme",
        "offload_dir": "/tmp/zk-off",
    }
    assert "offload optimizer+params (nvme)" in both.label
    facts = ModelFacts(1 << 26, ((256, 256),) * 64, (1 << 18,) * 16, 0, "")
    m = _measured(disk_read_bps=1e9, disk_write_bps=2e9)
    mem = {c.offload: tune_plan.predict_memory(c, facts, m)["model_state_bytes"] for c in g[2:]}
    n = facts.n_params
    # the moments leave RAM, the 48 MiB of staging join it
    assert mem["none"] - mem["optimizer"] == pytest.approx(8 * n / 2 - 48 * 2**20, rel=0.01)
    assert mem["optimizer"] > mem["both"]
    t = {c.offload: tune_plan.predict_time(c, facts, m) for c in g[2:]}
    assert t["none"]["offload_io_s"] == 0
    assert t["optimizer"]["offload_io_s"] == pytest.approx(8 * n / 1e9 + 8 * n / 2e9)
    assert t["both"]["offload_io_s"] == pytest.approx(20 * n / 1e9 + 12 * n / 2e9)
    assert t["both"]["step_time_s"] > t["optimizer"]["step_time_s"] > t["none"]["step_time_s"]


def test_quantization_in_the_grid_and_predictions():
    """--quantize-weights (stage 3) / --quantize-grads (stages 2/3, fp32 reduction): each
    combination once; ZeroOptimizer's kwargs and labels; the prediction moves the packed bytes
    and adds the measured quantize + dequantize time, so a cost above what the bytes save
    makes it slower."""
    from zero_kernels.cli.tune_model import ModelFacts

    g = tune_plan.grid(
        (1, 2, 3), (4.0,), (1,), ("fp32", "bf16"), (False,), True,
        quantize_weights=("none", "int8"), quantize_grads=("none", "int4"),
    )  # fmt: skip
    seen = sorted((c.stage, c.reduce_dtype, c.quantize_weights, c.quantize_grads) for c in g)
    assert seen == [
        (0, "fp32", "none", "none"), (1, "fp32", "none", "none"),
        (2, "bf16", "none", "none"), (2, "fp32", "none", "int4"), (2, "fp32", "none", "none"),
        (3, "bf16", "int8", "none"), (3, "bf16", "none", "none"),
        (3, "fp32", "int8", "int4"), (3, "fp32", "int8", "none"),
        (3, "fp32", "none", "int4"), (3, "fp32", "none", "none"),
    ]  # fmt: skip
    q = next(c for c in g if c.quantize_weights == "int8" and c.quantize_grads == "int4")
    assert q.policy_options() == {
        "stage": 3, "prefetch": 1, "quantize_weights": "int8", "quantize_grads": "int4"
    }  # fmt: skip
    assert "int8 weights" in q.label and "int4 grads" in q.label
    plain = TrialConfig(3, None, "fp32", 1)
    facts = ModelFacts(4 << 20, ((1024, 1024),) * 4, (1 << 20,) * 4, 0, "")
    free = _measured(quant_s_per_elem={"int8": 0.0, "int4": 0.0})
    t0 = tune_plan.predict_time(plain, facts, free)["comm_s"]
    t1 = tune_plan.predict_time(q, facts, free)["comm_s"]
    # 4 MiB gathers and reduce-scatters at 1.14 ms/MiB above 1 MiB, the latency below it
    assert t1 < 0.5 * t0, (t0, t1)
    dear = _measured(quant_s_per_elem={"int8": 1e-8, "int4": 1e-8})
    t2 = tune_plan.predict_time(q, facts, dear)["comm_s"]
    assert t2 == pytest.approx(t1 + 1e-8 * (2 * 4 + 4) * (1 << 20))
    assert t2 > t0  # a quantizer slower than the link: quantizing costs time here


def test_hierarchy_in_the_grid_predictions_and_recommendation():
    """Across nodes ([Note: tune across nodes]): every ZeRO configuration also with
    shard_group="node" and stage 3's with secondary_shard="node"; their kwargs and labels; the
    prediction reads the node and cross tables (a slow link across makes the node-sharded
    configuration faster, a fast one does not); without those tables it refuses; and the
    recommendation takes a hierarchical trial only where it beat its flat twin by more than
    the noise."""
    from zero_kernels.cli.tune_model import ModelFacts
    from zero_kernels.cli.tune_report import recommend

    g = tune_plan.grid((2, 3), (4.0,), (1,), ("fp32",), (False,), True, hierarchy=("world",))
    assert [c.shard_group for c in g] == ["world"] * 3
    g = tune_plan.grid(
        (2, 3), (4.0,), (1,), ("fp32",), (False,), True, hierarchy=("world", "node", "secondary")
    )
    seen = sorted((c.stage, c.shard_group, str(c.secondary_shard)) for c in g)
    assert seen == [
        (0, "world", "None"), (2, "node", "None"), (2, "world", "None"),
        (3, "node", "None"), (3, "world", "None"), (3, "world", "node"),
    ]  # fmt: skip
    node3 = next(c for c in g if c.stage == 3 and c.shard_group == "node")
    hpz = next(c for c in g if c.secondary_shard == "node")
    assert node3.policy_options() == {"stage": 3, "prefetch": 1, "shard_group": "node"}
    assert hpz.policy_options() == {"stage": 3, "prefetch": 1, "secondary_shard": "node"}
    assert "shard_group node" in node3.label and "secondary_shard node" in hpz.label
    facts = ModelFacts(4 << 20, ((1024, 1024),) * 4, (1 << 20,) * 4, 0, "")
    fast = _measured().bandwidth

    def slow(k):  # every collective k times the fast table's time
        return {key: tuple((b, k * t) for b, t in pts) for key, pts in fast.items()}

    with pytest.raises(ValueError, match="needs the bandwidth inside and across nodes"):
        tune_plan.predict_time(node3, facts, _measured(world_size=4))
    plain = TrialConfig(3, None, "fp32", 1)
    for world_k, cross_k, node_wins in ((10.0, 10.0, True), (1.0, 1.0, False)):
        m = _measured(world_size=4, bandwidth=slow(world_k), ranks_per_node=2,
                      links={"node": fast, "cross": slow(cross_k)})  # fmt: skip
        t_flat = tune_plan.predict_time(plain, facts, m)["step_time_s"]
        t_node = tune_plan.predict_time(node3, facts, m)["step_time_s"]
        t_hpz = tune_plan.predict_time(hpz, facts, m)["step_time_s"]
        assert (t_node < t_flat) == node_wins, (world_k, t_node, t_flat)
        assert (t_hpz < t_flat) == node_wins, (world_k, t_hpz, t_flat)

    def trial(c, t, spread=0.01):
        return {"config": c.as_dict(), "status": "measured", "fits": True,
                "measured": {"step_time_s": t, "spread": spread}}  # fmt: skip

    for t_node, spread, want in ((0.90, 0.01, node3), (0.99, 0.05, plain), (1.2, 0.01, plain)):
        best, _ = recommend([trial(plain, 1.0, spread), trial(node3, t_node, spread)])
        assert best["config"]["label"] == want.label, (t_node, spread, best)


@pytest.mark.distributed
def test_quantized_trials_run(tmp_path):
    """A real run with quantized weights and gradients: the probe times the quantizer, every
    trial is measured, each quantized one is set beside its unquantized twin in tune.json and
    the verdict, and the recommendation is the fastest that fits."""
    args = ["--model-size", "tiny", "--stages", "3", "--prefetch", "1", "--reduce-dtypes"]
    args += ["fp32", "--no-ddp", "--quantize-weights", "none,int8", "--quantize-grads"]
    args += ["none,int8"]
    rc, stdout, stderr = _run(tmp_path, *args)
    assert rc == 0, stderr
    res = json.loads((tmp_path / "tune.json").read_text())
    assert res["compute"]["quantize_dequantize_s_per_elem"]["int8"] > 0
    assert len(res["trials"]) == 4 and all(t["status"] == "measured" for t in res["trials"])
    pairs = res["quantization"]
    assert len(pairs) == 3 and {p["unquantized"] for p in pairs} == {
        "stage 3, prefetch 1, fp32 reduce"
    }
    spread = {t["config"]["label"]: t["measured"]["spread"] for t in res["trials"]}
    for p in pairs:
        a, b = p["step_time_s"], p["unquantized_step_time_s"]
        noise = max(spread[p["label"]], spread[p["unquantized"]]) * max(a, b)
        want = "within noise" if abs(a - b) <= noise else "faster" if a < b else "slower"
        assert p["verdict"] == want, (p, noise)
        assert f"quantized: {p['label']}" in stdout
    # the fastest, unless it is quantized and did not beat its unquantized twin (then that)
    best = _fits_and_fastest(res)["config"]["label"]
    verdict = {p["label"]: (p["verdict"], p["unquantized"]) for p in pairs}.get(best)
    if verdict is not None and verdict[0] != "faster":
        best = verdict[1]
    assert res["recommendation"]["label"] == best, (res["recommendation"], pairs)


@pytest.mark.distributed
def test_offload_trials_run(tmp_path):
    """A real run with --offload both and int8 state: the disk measured, the int8 step timed
    by the probe, the offload trial measured beside the one in RAM, its files gone after."""
    args = ["--model-size", "tiny", "--stages", "3", "--prefetch", "1", "--reduce-dtypes"]
    args += ["fp32", "--state-dtypes", "int8", "--no-ddp", "--offload", "none,both"]
    rc, _, stderr = _run(tmp_path, *args)
    assert rc == 0, stderr
    res = json.loads((tmp_path / "tune.json").read_text())
    steps = res["compute"]["optimizer_step_s"]
    assert steps["fused kernel, 1/N of the params, int8 state"] > 0, steps
    assert {t["config"]["state_dtype"] for t in res["trials"]} == {"int8"}
    assert res["disk"]["read_gbps"] > 0 and res["disk"]["direct"] in (True, False)
    got = {t["config"]["offload"]: t for t in res["trials"]}
    assert set(got) == {"none", "both"} and all(t["status"] == "measured" for t in got.values())
    assert got["both"]["policy_options"]["offload_params"] == "nvme"
    assert os.listdir(tmp_path / "offload") == []
