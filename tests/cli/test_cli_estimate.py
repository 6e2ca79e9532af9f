"""The estimator: the ZeRO paper's figures, parsing, config.json / meta-device models."""

import json
import math
import subprocess
import sys

import pytest

from zero_kernels.cli.main import main
from zero_kernels.comm import shm as comm_shm
from zero_kernels.tools import estimate as est
from zero_kernels.tools.estimate_links import cross_node


def test_paper_figures():
    # ZeRO paper, figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12).
    e = est.estimate(est.parse_count("7.5B"), 64)
    assert [round(s.total_bytes / 1e9, 1) for s in e.stages] == [120.0, 31.4, 16.6, 1.9]
    assert [s.comm_elements / 7.5e9 for s in e.stages] == [2, 2, 2, 3]


def test_paper_figures_printed(capsys):
    assert main(["estimate", "--params", "7.5B", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    for figure in ("120.0 GB", "31.4 GB", "16.6 GB", "1.88 GB"):
        assert figure in out, out
    assert "K = 12" in out


def test_fits(capsys):
    assert main(["estimate", "--params", "7.5B", "-n", "64", "--gpu-mem", "32GB"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:6]]
    assert [r[-1] for r in rows] == ["no", "yes", "yes", "yes"]


@pytest.mark.parametrize(
    "text,value",
    [
        ("7.5B", 7_500_000_000),
        ("1.3e9", 1_300_000_000),
        ("125M", 125_000_000),
        ("350k", 350_000),
        ("7_000_000", 7_000_000),
    ],
)
def test_parse_count(text, value):
    assert est.parse_count(text) == value


@pytest.mark.parametrize("bad", ["", "7.5Q", "-3B", "abc", "0"])
def test_parse_count_rejects(bad):
    with pytest.raises(ValueError, match="--params"):
        est.parse_count(bad)


def test_parse_bytes():
    assert est.parse_bytes("80GB") == 80e9
    assert est.parse_bytes("80") == 80e9
    assert est.parse_bytes("24GiB") == 24 * 2**30
    assert est.parse_bytes("4096B") == 4096 and est.parse_bytes("1.5kB") == 1500
    with pytest.raises(ValueError, match="--gpu-mem"):
        est.parse_bytes("lots")


def test_precisions_and_optimizers():
    psi = 1_000_000
    fp32 = est.estimate_stage(0, psi, 1, precision="fp32", optimizer="adam")
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optim_bytes) == (4 * psi, 4 * psi, 8 * psi)
    sgd = est.estimate_stage(0, psi, 1, precision="mixed", optimizer="sgd-momentum")
    assert sgd.optim_bytes == 8 * psi  # master 4 + momentum 4
    s2 = est.estimate_stage(2, psi, 4, precision="mixed", optimizer="adam")
    assert s2.total_bytes == 2 * psi + 14 * psi / 4
    assert s2.reduce_scatter_bytes == 2 * psi and s2.all_gather_bytes == 2 * psi
    assert s2.wire_bytes == pytest.approx(0.75 * 4 * psi)


def test_adafactor_factored_from_shapes():
    shapes = [(100, 200), (200,)]
    got = est.optimizer_state_bytes("adafactor", "fp32", 100 * 200 + 200, shapes)
    assert got == 4 * (100 + 200 + 200)


def _write(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_gpt2_config(tmp_path):
    p = _write(
        tmp_path,
        {
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_embd": 768,
            "n_layer": 12,
            "n_positions": 1024,
            "n_head": 12,
        },
    )
    assert est.model_info(p).n_params == 124_439_808  # GPT-2 small, tied head


def test_llama_config(tmp_path, capsys):
    p = _write(
        tmp_path,
        {
            "model_type": "llama",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
        },
    )
    info = est.model_info(p)
    assert info.n_params == 6_738_415_616  # Llama-2-7B
    assert main(["estimate", "--model", p, "-n", "8"]) == 0
    assert "6.738B params" in capsys.readouterr().out


def test_meta_factory_matches_real_model():
    import torch

    from zero_kernels.tools.models import build_gpt

    info = est.model_info("zero_kernels.tools.models:gpt_small")
    real = build_gpt("small")
    assert info.n_params == sum(p.numel() for p in real.parameters())  # tied head counted once
    assert info.largest_layer == sum(p.numel() for p in real.blocks[0].parameters())
    e = est.estimate(model="zero_kernels.tools.models:gpt_small", world_size=4)
    s3 = e.stages[3]
    assert s3.live_bytes == 2 * info.largest_layer * 2  # running + prefetched layer, bf16
    assert s3.comm_buffer_bytes == 2 * info.largest_layer * 4  # two layers of fp32 grads
    assert not any(t.is_meta for t in real.parameters())
    del torch


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["estimate", "--params", "1B", "-n", "2", "--precision", "fp8"], "--precision"),
        (["estimate", "--params", "1B", "-n", "2", "--optimizer", "nadam2"], "--optimizer"),
        (["estimate", "--params", "1B", "--world-size", "0"], "--world-size"),
        (["estimate", "--model", "nosuchmodule_xyz:factory", "-n", "2"], "--model"),
        (["estimate", "--model", "/nonexistent/config.json", "-n", "2"], "--model"),
        (["estimate"], "--params"),
        (["estimate", "--params", "1B"], "--world-size"),  # required: no silent world size 1
        (["estimate", "--params", "1B", "--json"], "--world-size"),
        (
            ["estimate", "--params", "1B", "-n", "2", "--offload-optimizer", "disk"],
            "--offload-optimizer",
        ),
        (
            "estimate --params 1B -n 2 --offload-optimizer cpu --offload-params nvme".split(),
            "--offload-params cpu goes with --offload-optimizer cpu",
        ),
        (
            "estimate --params 1B -n 2 --offload-params cpu".split(),
            "--offload-params cpu goes with --offload-optimizer cpu",
        ),
        (
            [
                "estimate",
                "--params",
                "1B",
                "-n",
                "2",
                "--optimizer",
                "sgd",
                "--offload-optimizer",
                "nvme",
            ],
            "--offload-optimizer",
        ),
    ],
)
def test_estimate_bad_arguments(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_comm_buffers_beside_model_states(capsys):
    # stage 2's in-flight bucket buffers (2 x ZeroOptimizer's 25 MiB): reported, not in totals
    e = est.estimate(est.parse_count("7.5B"), 64)
    assert [s.comm_buffer_bytes for s in e.stages] == [0, 0, 2 * 25 * 2**20, 0]
    assert [round(s.total_bytes / 1e9, 1) for s in e.stages] == [120.0, 31.4, 16.6, 1.9]
    assert (
        main(["estimate", "--params", "1M", "-n", "4", "--precision", "fp32", "--bucket-mb", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "stage 2: + 2.1 MB of comm buffers" in out, out
    # receive buffers: stage 1 3/4 of 2 x 1 MiB in place, stage 2 2/4 of its 2.1 MB of buffers
    assert "stage 1: + 1.57 MB of receive buffers (--model adds" in out, out
    assert "stage 2: + 1.05 MB of receive buffers" in out, out
    assert "scratch stage 0" not in out and "scratch stage 3" not in out, out


def test_mixed_fp32_grads_is_what_zero_holds(capsys):
    psi = 1_000_000
    s1 = est.estimate_stage(1, psi, 4, precision="mixed-fp32-grads")
    assert s1.total_bytes == (2 + 4) * psi + 12 * psi / 4
    s2 = est.estimate_stage(2, psi, 4, precision="mixed-fp32-grads")
    assert s2.total_bytes == 2 * psi + (4 + 12) * psi / 4
    assert main(["estimate", "--params", "7.5B", "-n", "64"]) == 0
    assert "mixed-fp32-grads" in capsys.readouterr().out  # the default says what it counts


def test_bf16_sr_has_no_master(capsys):
    """bf16_stochastic_round: the master's 4 bytes per param gone, grads and moments fp32."""
    psi = 1_000_000
    s2 = est.estimate_stage(2, psi, 4, precision="bf16-sr")
    assert s2.total_bytes == 2 * psi + (4 + 8) * psi / 4
    k = est.optimizer_state_bytes("adam", "bf16-sr", psi, state_dtype="int8")
    assert k == (2 + 8 / 256) * psi  # int8 moments, nothing else
    assert main(["estimate", "--params", "7.5B", "-n", "64", "--precision", "bf16-sr"]) == 0
    assert "without a master (stochastic rounding)" in capsys.readouterr().out


def _comm_column(out: str) -> list[str]:
    """The comm/step column of the printed table, stages 0-3 (fixed-width columns)."""
    lines = out.splitlines()
    head = lines[1]
    start = head.index("params") + len("params") + 4 * 10  # after params/grads/optim/live/total
    return [ln[start : start + 12].strip() for ln in lines[2:6]]


@pytest.mark.parametrize(
    "precision,column",
    [
        # the ZeRO paper: 2Ψ (DDP all-reduce), Ψ reduce-scatter + Ψ all-gather, 3Ψ; 2 bytes each
        ("mixed", ["30 GB", "30 GB", "30 GB", "45 GB"]),
        ("fp32", ["60 GB", "60 GB", "60 GB", "90 GB"]),
    ],
)
def test_comm_column_is_the_papers_volume(precision, column, capsys):
    e = est.estimate(est.parse_count("7.5B"), 64, precision=precision)
    elem = 2 if precision == "mixed" else 4
    assert [s.comm_bytes for s in e.stages] == [s.comm_elements * elem for s in e.stages]
    assert [s.comm_bytes / 7.5e9 / elem for s in e.stages] == [2, 2, 2, 3]
    argv = ["estimate", "--params", "7.5B", "-n", "64", "--precision", precision]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "comm/step" in out.splitlines()[1]
    assert _comm_column(out) == column, out
    assert "2Ψ elements for DDP (all-reduce) and stages 1-2" in out  # the note says the same


def test_comm_bytes_of_each_dtype():
    # ZeroOptimizer's precision: fp32 grads reduce-scattered (4Ψ), bf16 params gathered (2Ψ)
    psi = 1_000_000
    s0 = est.estimate_stage(0, psi, 4, precision="mixed-fp32-grads")
    s2 = est.estimate_stage(2, psi, 4, precision="mixed-fp32-grads")
    s3 = est.estimate_stage(3, psi, 4, precision="mixed-fp32-grads")
    assert (s0.comm_bytes, s2.comm_bytes, s3.comm_bytes) == (8 * psi, 6 * psi, 8 * psi)
    assert s0.all_reduce_bytes == 4 * psi  # the payload stays the buffer's size


def test_model_factory_needing_arguments_names_model(capsys):
    assert main(["estimate", "--model", "torch.nn:Linear", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--model" in err[0] and "'torch.nn:Linear'" in err[0], err
    assert "no arguments" in err[0] and "in_features" in err[0], err


def test_model_factory_failing_names_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "zk_bad_factory.py").write_text(
        "def build():\n    raise RuntimeError('no meta support here')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "--model", "zk_bad_factory:build", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--model 'zk_bad_factory:build'" in err[0] and "no meta support here" in err[0], err


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_closed_pipe_exits_quietly(extra):
    # `zero-kernels estimate ... | head -1`: the reader is gone before the table is written
    p = subprocess.Popen(
        [sys.executable, "-m", "zero_kernels", "estimate", "--params", "7.5B", "-n", "64", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert err == "", err
    assert rc == 141, rc  # 128 + SIGPIPE, as a shell reports a tool killed by SIGPIPE


def test_stage3_without_resharding():
    """reshard_after_forward=False: the live window is the whole model (every unit gathered from
    its forward to its backward) and params are gathered once per step (2 psi, not 3)."""
    kw = dict(precision="fp32", optimizer="adamw", largest_layer=1000, root_params=200)
    on = est.estimate_stage(3, 10_000, 4, **kw)
    off = est.estimate_stage(3, 10_000, 4, reshard_after_forward=False, **kw)
    assert on.live_bytes == (200 + 2 * 1000) * 4 and off.live_bytes == 10_000 * 4
    assert on.all_gather_bytes == 2 * off.all_gather_bytes == 2 * 10_000 * 4
    assert on.comm_elements == 30_000 and off.comm_elements == 20_000
    assert off.total_bytes - on.total_bytes == off.live_bytes - on.live_bytes


def test_scratch_bytes():
    # receive buffers of the pairwise reduce-scatter and autograd's largest gradient, per stage:
    # MLP-like model, 67.1M fp32 params in 8 units of 8.39M, N = 4, two 25 MiB buckets in flight
    psi, layer, n = 8 * 2896 * 2896, 2896 * 2896, 4
    kw = dict(precision="fp32", optimizer="adamw", largest_param=layer)
    s = [
        est.estimate_stage(k, psi, n, largest_layer=layer if k == 3 else None, **kw)
        for k in range(4)
    ]
    grad = 4 * layer
    assert s[0].scratch_bytes == grad  # DDP: the gradient only
    assert s[1].scratch_bytes == 3 / 4 * 2 * 25 * 2**20 + grad  # in place: N-1 shards per bucket
    assert s[2].scratch_bytes == 2 / 4 * s[2].comm_buffer_bytes + grad  # N-2 shards per buffer
    assert s[3].scratch_bytes == 2 / 4 * (2 * layer * 4) + grad
    assert est.estimate_stage(3, psi, 2, largest_layer=layer, **kw).scratch_bytes == grad
    # ranks on one host: the shm slots instead of receive buffers, bounded whatever the model
    shm = [
        est.estimate_stage(st, psi, 4, comm_scratch="shm", largest_layer=layer, **kw)
        for st in range(4)
    ]
    assert [x.scratch_bytes - grad for x in shm] == [0, 8 * 2**20, 8 * 2**20, 16 * 2**20]
    assert est.SHM_SLOT_BYTES == comm_shm.SLOTS * comm_shm.SLOT_BYTES
    both = est.estimate_stage(2, psi, 4, comm_scratch="pairwise+shm", **kw).scratch_bytes
    assert both == s[2].scratch_bytes + 8 * 2**20
    with pytest.raises(ValueError, match="comm_scratch"):
        est.estimate_stage(2, psi, 4, comm_scratch="tcp")
    assert (
        est.estimate_stage(2, psi, 4, precision="fp32").scratch_bytes == s[2].scratch_bytes - grad
    )
    # the model-based estimate takes the largest param from the model's shapes
    e = est.estimate(model="zero_kernels.tools.models:gpt_small", world_size=2)
    info = est.model_info("zero_kernels.tools.models:gpt_small")
    largest = max(math.prod(x) for x in info.shapes)
    assert e.stages[0].scratch_bytes == largest * 2  # bf16 params: a bf16 gradient
    # the fit check counts it
    s3 = s[3]
    need = s3.total_bytes + s3.comm_buffer_bytes + s3.scratch_bytes
    assert est.estimate_stage(3, psi, n, largest_layer=layer, gpu_mem=int(need), **kw).fits
    assert not est.estimate_stage(3, psi, n, largest_layer=layer, gpu_mem=int(need) - 8, **kw).fits


def test_cross_node_bytes_match_the_testbed(capsys):
    """`cross_node` per node per step at 2 nodes x 2 ranks, fp32, Ψ = 7.52M (M = 4Ψ bytes): the
    formula bench/bench_testbed.py measured (tc counts 1.047x it: headers): DDP 1.5 M, ring
    stages 1/2 1.5 M, stage 3 2.25 M, shard_group="node" 1 M; int8 weights cut stage 3's two
    gathers to (1 + 4/256) / 4 of their bytes."""
    psi = 7.52e6
    m = 4 * psi
    one_hop = dict(precision="fp32", grad_hops=1)  # quantized grads as the testbed measured
    rows = {r["config"]: r["bytes"] for r in cross_node(int(psi), 2, 2, **one_hop)}
    assert rows["DDP"] == pytest.approx(1.5 * m)
    assert rows["stage 1"] == rows["stage 2"] == pytest.approx(1.5 * m)
    assert rows["stage 3"] == pytest.approx(2.25 * m)
    assert rows["stage 1-3, shard_group=node"] == pytest.approx(1.0 * m)
    assert rows["stage 3, int8 weights"] == pytest.approx(0.75 * (m + 2 * psi * (1 + 4 / 256)))
    # int8 gradients, one hop: each node sends its 2 ranks' chunks for the other node's 2 ranks
    q8 = psi * (1 + 4 / 256)
    assert rows["stage 3, int8 weights + int8 grads"] == pytest.approx(0.75 * 2 * q8 + q8)
    assert rows["stage 2, int8 grads"] == pytest.approx(0.75 * m + q8)
    q4 = psi * (0.5 + 4 / 32)  # int4 gradients: one scale per 32 elements
    assert rows["stage 3, int8 weights + int4 grads"] == pytest.approx(0.75 * 2 * q8 + q4)
    # what the testbed's tc counted for int8 weights + int8 grads (docs/benchmarks.md, "Quantized
    # communication on the testbed"): 20.0 MB per node per step, headers 1.047x
    assert rows["stage 3, int8 weights + int8 grads"] * 1.047 == pytest.approx(20.0e6, rel=0.05)
    # secondary_shard=node (hpZ): only the forward's gathers cross; what tc counted with it
    # (docs/benchmarks.md, "The secondary shard on the testbed"): 47.3 / 14.1 / 10.1 MB
    hpz = "stage 3, secondary_shard=node"
    assert rows[hpz] == pytest.approx(1.5 * m)
    assert rows[hpz + " + int8 weights + int8 grads"] == pytest.approx(0.75 * q8 + q8)
    assert rows[hpz + " + int8 weights + int4 grads"] == pytest.approx(0.75 * q8 + q4)
    # (10.1 MB was measured with int4 gradients in blocks of 256: 4/256 of a scale per element)
    old_block = psi * (4 / 32 - 4 / 256)
    for key, tc, then in (
        (hpz, 47.3e6, 0),
        (hpz + " + int8 weights + int4 grads", 10.1e6, old_block),
    ):
        assert (rows[key] - then) * 1.047 == pytest.approx(tc, rel=0.05), key
    one = {r["config"]: r["bytes"] for r in cross_node(int(psi), 1, 4)}
    assert set(one.values()) == {0.0}  # one node: nothing crosses
    assert main(["estimate", "--params", "7.52M", "-n", "4", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "across nodes (2 nodes x 2 ranks" in out and "shard_group=node" in out
    assert main(["estimate", "--params", "7.52M", "-n", "4", "--nodes", "3"]) == 2
    assert "--nodes must be >= 1 and divide --world-size 4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--nodes and ranks per node must be >= 1"):
        cross_node(10, 0, 2)


def test_offload_optimizer(capsys):
    """--offload-optimizer nvme: the fp32 moments (8 bytes/param) leave RAM for the disk, the
    staging buffers join the total, a step reads and writes the moments once; DDP unchanged."""
    plain = est.estimate(10**9, 4, precision="mixed")
    off = est.estimate(10**9, 4, precision="mixed", offload_optimizer="nvme", offload_staging_mb=64)
    assert off.stages[0] == plain.stages[0]
    for a, b in zip(plain.stages[1:], off.stages[1:]):
        moments = 8 * 10**9 / 4
        assert b.offload_disk_bytes == moments
        assert b.optim_bytes == a.optim_bytes - moments  # the fp32 masters stay
        assert b.offload_staging_bytes == 64 * 2**20
        assert b.total_bytes == a.total_bytes - moments + 64 * 2**20
        assert b.offload_io_bytes == 2 * moments
    assert main(["estimate", "--params", "1B", "-n", "4", "--offload-optimizer", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "offload stage 3: Adam moments on disk, 2 GB per rank" in out, out
    assert "4 GB read + written per step" in out


def test_offload_optimizer_cpu(capsys):
    """--offload-optimizer cpu (the host tier): masters and moments leave the device for host
    memory with the pinned staging of a gradient and a param shard; the bus carries those two
    shards a step (and fp32 params' shard down: no master)."""
    psi, n = 10**9, 4
    plain = est.estimate(psi, n, precision="mixed")
    off = est.estimate(psi, n, precision="mixed", offload_optimizer="cpu")
    for a, b in zip(plain.stages[1:], off.stages[1:]):
        assert b.optim_bytes == 0 and b.total_bytes == a.total_bytes - a.optim_bytes
        assert b.offload_host_bytes == a.optim_bytes + (2 + 2) * psi / n
        assert b.offload_bus_bytes == (2 + 2) * psi / n
    fp32 = est.estimate_stage(2, psi, n, precision="fp32", offload_optimizer="cpu")
    assert fp32.offload_bus_bytes == (4 + 4 + 4) * psi / n
    assert main(["estimate", "--params", "1B", "-n", "4", "--offload-optimizer", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "offload stage 2: masters and Adam moments in host memory, 4 GB per rank" in out, out
    # stage 3 with the param shards on the host too: off the device, copied in per all-gather
    both = est.estimate_stage(3, psi, n, offload_optimizer="cpu", offload_params="cpu")
    one = off.stages[3]
    assert both.params_bytes == 0 and both.total_bytes == one.total_bytes - one.params_bytes
    assert both.offload_host_bytes == one.offload_host_bytes  # the shard replaces its staging
    assert both.offload_bus_bytes == (2 + 2 * 2) * psi / n  # grads down, 2 gathers' inputs up
    argv = "estimate --params 1B -n 4 --offload-optimizer cpu --offload-params cpu".split()
    assert main(argv) == 0
    assert "Adam moments and param shards in host memory" in capsys.readouterr().out


def test_offload_params():
    """--offload-params nvme (stage 3): param shards and fp32 masters on disk as well; a step
    reads each shard three times and writes it once, the masters once each way."""
    psi, n = 10**9, 4
    base = est.estimate_stage(3, psi, n, precision="mixed", offload_optimizer="nvme")
    both = est.estimate_stage(
        3, psi, n, precision="mixed", offload_optimizer="nvme", offload_params="nvme"
    )
    shard, masters = 2 * psi / n, 4 * psi / n
    assert both.params_bytes == 0 and base.params_bytes == shard
    assert both.optim_bytes == base.optim_bytes - masters == 0
    assert both.offload_disk_bytes == base.offload_disk_bytes + shard + masters
    assert both.offload_io_bytes == base.offload_io_bytes + 4 * shard + 2 * masters
    with pytest.raises(ValueError, match="stage-3 option"):
        est.estimate_stage(2, psi, n, offload_params="nvme")


def test_state_dtype():
    """--state-dtype: stages 1-3 count the fused step's moments at 4 (bf16) or 2 + 8/block
    (int8) bytes per param instead of 8, masters as they are; DDP's row unchanged; the
    measured ZeroOptimizer agrees (tests/precision/lowbit_checks.py asserts its memory_report)."""
    plain = est.estimate(10**9, 4, precision="mixed")
    for sd, per in (("bf16", 4.0), ("int8", 2 + 8 / 256)):
        low = est.estimate(10**9, 4, precision="mixed", state_dtype=sd)
        assert low.stages[0] == plain.stages[0]
        for a, b in zip(plain.stages[1:], low.stages[1:]):
            assert b.optim_bytes == pytest.approx(a.optim_bytes - (8 - per) * 10**9 / 4)
    fp32 = est.estimate(10**9, 4, precision="fp32", state_dtype="int8", stages=[3])
    assert fp32.stages[0].optim_bytes == pytest.approx((2 + 8 / 256) * 10**9 / 4)  # no master
    with pytest.raises(ValueError, match="fused Adam step's format"):
        est.estimate(10**9, 4, optimizer="sgd-momentum", state_dtype="int8")
    off = est.estimate(10**9, 4, state_dtype="bf16", offload_optimizer="nvme")
    assert off.stages[1].offload_disk_bytes == 4 * 10**9 / 4  # bf16 moments: half the file
    off = est.estimate(10**9, 4, state_dtype="int8", offload_optimizer="nvme")
    assert off.stages[1].offload_disk_bytes == pytest.approx((2 + 8 / 256) * 10**9 / 4)
    assert main(["estimate", "--params", "1B", "-n", "4", "--state-dtype", "int8"]) == 0


def test_shard_group_and_secondary_shard(capsys):
    """Hierarchical sharding (shards over K ranks, the gradient shards all-reduced across the
    N/K replicas) and hpZ's secondary shard (1/S of the non-root params from the forward to
    the backward, the backward's gathers over S ranks), against the formulas."""
    psi, N, K, S = 10**6, 8, 4, 2
    flat = est.estimate_stage(3, psi, N, precision="fp32")
    hier = est.estimate_stage(3, psi, N, precision="fp32", shard_size=K)
    assert hier.params_bytes == 4 * psi / K and hier.total_bytes == 16 * psi / K
    assert hier.all_reduce_bytes == 4 * psi / K  # the gradient shard across the replicas
    assert hier.wire_bytes == pytest.approx((K - 1) / K * 12 * psi + 2 * (1 / 2) * 4 * psi / K)
    for stage in (1, 2):  # the optimizer state (and at 2 the grads) over K, not N
        h = est.estimate_stage(stage, psi, N, precision="fp32", shard_size=K)
        assert h.optim_bytes == 8 * psi / K and h.shard_size == K
    hp = est.estimate_stage(3, psi, N, precision="fp32", secondary_shard=S, root_params=10**5)
    assert hp.secondary_bytes == 4 * (psi - 10**5) / S
    assert hp.total_bytes == flat.total_bytes + hp.secondary_bytes
    assert hp.wire_bytes == pytest.approx(flat.wire_bytes - (7 / 8 - 1 / 2) * 4 * psi)
    bad = [
        (dict(stage=3, shard_size=3), "--shard-group must be a rank count dividing"),
        (dict(stage=0, shard_size=4), "not DDP's"),
        (dict(stage=2, secondary_shard=2), "--secondary-shard is a stage-3 option"),
        (dict(stage=3, shard_size=4, secondary_shard=8), "dividing the shard group's 4"),
    ]
    for kw, needle in bad:
        with pytest.raises(ValueError, match=needle):
            est.estimate_stage(n_params=psi, world_size=N, **kw)
    argv = ["estimate", "--params", "1B", "-n", "16", "--nodes", "2"]
    assert main([*argv, "--shard-group", "node", "--secondary-shard", "4", "--json"]) == 0
    rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert rows[3]["shard_size"] == 8 and rows[3]["secondary_bytes"] == 2e9 / 4
    assert rows[0]["shard_size"] == 16 and rows[0]["secondary_bytes"] == 0  # DDP as it is
    assert main([*argv[:-2], "--secondary-shard", "node"]) == 2
    assert "needs --nodes" in capsys.readouterr().err


def test_frozen_params_whole_on_every_rank(tmp_path, monkeypatch, capsys):
    """Params that do not train (a frozen base under adapters) count at every stage, whole on
    every rank: --frozen with --params, a model's own requires_grad=False params with --model.
    Before, the estimate left them out (a 7B frozen base: 14 GB per rank missing)."""
    base = est.estimate(40_000_000, 8)
    with_base = est.estimate(40_000_000, 8, frozen=7_000_000_000)
    for a, b in zip(base.stages, with_base.stages):
        assert b.frozen_bytes == 14e9 and b.total_bytes - a.total_bytes == 14e9, (a, b)
    assert main(["estimate", "--params", "40M", "--frozen", "7B", "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "40M params + 7B frozen" in out and "includes 14 GB of frozen params" in out, out
    (tmp_path / "zk_adapters.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))\n"
        "    m[0].requires_grad_(False)\n"
        "    return m\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    e = est.estimate(model="zk_adapters:build", world_size=2, precision="fp32")
    assert e.n_params == 1010 and e.frozen_params == 10100, e
    assert all(s.frozen_bytes == 4 * 10100 for s in e.stages)
    assert main(["estimate", "--model", "zk_adapters:build", "--frozen", "1M", "-n", "2"]) == 2
    assert "--frozen goes with --params" in capsys.readouterr().err


def test_shard_frozen_divides_the_frozen_bytes_at_stage_3(capsys):
    """--shard-frozen (ZeroOptimizer(shard_frozen=True)): stage 3 holds 1/N of the frozen params
    and all-gathers them twice per step (forward and backward) as it does the trained ones;
    stages 0-2 keep them whole."""
    whole = est.estimate(40_000_000, 8, frozen=7_000_000_000)
    sharded = est.estimate(40_000_000, 8, frozen=7_000_000_000, shard_frozen=True)
    for a, b in zip(whole.stages, sharded.stages):
        if a.stage != 3:
            assert a == b, (a, b)
            continue
        assert b.frozen_bytes == 14e9 / 8, b
        assert a.total_bytes - b.total_bytes == 14e9 * 7 / 8, (a, b)
        assert b.comm_bytes - a.comm_bytes == 2 * 14e9, (a, b)
        assert abs(b.wire_bytes - a.wire_bytes - 2 * 14e9 * 7 / 8) < 1, (a, b)
    assert main(["estimate", "--params", "40M", "--frozen", "7B", "-n", "8", "--shard-frozen"]) == 0
    out = capsys.readouterr().out
    assert "1/N at stage 3 (1.75 GB" in out, out
