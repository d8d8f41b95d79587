"""Many processes on the CPU (gloo, 2 ranks): DDP and FSDP2 over an applied module, the loss
scaler's agreement across ranks, bf16 gradient communication, ``train --nproc`` and the memory
of sharded training state (docs/architecture.md#runtime).

Ranks are spawned with ``torch.multiprocessing`` (rendezvous through a file store in ``tmp_path``)
and every run has a deadline: a rank that hangs or crashes fails the test, never blocks it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch import nn

import autoprec
from autoprec.cli import main
from autoprec.commands.launch import strip_nproc
from autoprec.commands.train import train
from autoprec.distributed.wrap import ddp, shard
from autoprec.errors import PolicyError
from autoprec.policy import REGIONAL_EMULATED, Batching, Policy
from autoprec.training.rank_flag import any_rank
from autoprec.training.scaler import DynamicLossScaler
from tests.conftest import DRIFT, MODELS

WORLD = 2
DEADLINE_S = 150


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _run_ranks(fn, out: Path, *args, world: int = WORLD, timeout: float = DEADLINE_S) -> list[dict]:
    """Run ``fn(rank, world, out, *args)`` on ``world`` spawned ranks; each saves ``out/rank{r}.pt``."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = tmp.start_processes(_entry, args=(fn, world, str(out), args), nprocs=world, join=False,
                              start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _entry(rank: int, fn, world: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), Path(out) / f"rank{rank}.pt")
        # The DDP module fn built outlives fn's return in a reference cycle, and its C++ reducer holds
        # the gloo group (and its threads) past destroy_process_group until the cyclic GC runs - at
        # an arbitrary time, sometimes during interpreter teardown: "terminate called without an
        # active exception", SIGABRT (1 run in ~12). Collect it now, while the group is whole.
        gc.collect()
        dist.barrier()  # no rank tears gloo down while another still uses it
    finally:
        dist.destroy_process_group()
        gc.collect()


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# ------------------------------------------------------------------------- the DDP crash's cause


class _OwnParam(nn.Module):
    """A model with a Parameter of its own besides its submodules'."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


@pytest.mark.parametrize("make", [_mlp, _OwnParam], ids=["sequential", "own_param"])
def test_ddp_collection_rule_reaches_every_parameter(make):
    """DDP builds its reducer from ``named_modules()`` x ``named_parameters(recurse=False)``
    (torch/nn/parallel/distributed.py ``_build_params_for_reducer``). Over the applied module this
    found nothing for an ``nn.Sequential`` - an empty list that ``_verify_params_across_processes``
    crashes on (the SIGSEGV) - and only the root's own Parameter for ``_OwnParam``."""
    model = make()
    mp = autoprec.apply(model, Policy.default("bf16"), (torch.randn(4, 8),), compile=False)
    collected = [p for _, m in mp.named_modules() for _, p in m.named_parameters(recurse=False)]
    assert [id(p) for p in collected] == [id(p) for p in model.parameters()]
    assert [n for n, _ in mp.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    assert list(mp.state_dict()) == list(model.state_dict())  # keys unchanged


# ----------------------------------------------------------------------------------- DDP ranks


def _ddp_worker(rank: int, world: int, compile: bool, reduce: str) -> dict:
    torch.manual_seed(rank)  # different initial weights on each rank: DDP broadcasts rank 0's
    model = _mlp()
    policy = dataclasses.replace(Policy.default("bf16"), grad_reduce_dtype=reduce)
    mp = autoprec.apply(model, policy, (torch.randn(4, 8),), compile=compile)
    module = ddp(mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in range(4):
        g = torch.Generator().manual_seed(100 + k * world + rank)
        module(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    flat = _flat_params(model)
    return {"equal": all(torch.equal(flat, other) for other in _gathered(flat)), "flat": flat}


@pytest.mark.heavy
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_ddp_keeps_parameters_bitwise_equal_across_ranks(tmp_path, compile):
    res = _run_ranks(_ddp_worker, tmp_path, compile, "fp32")
    assert all(r["equal"] for r in res)
    assert torch.isfinite(res[0]["flat"]).all()


@pytest.mark.heavy
def test_ddp_bf16_gradient_reduction_drifts_little(tmp_path):
    """``grad_reduce_dtype: bf16`` registers the bf16 compress hook (under gloo: autoprec's
    ``bf16_hook``, torch refusing its own by name there); ranks stay bitwise equal and the weights
    differ from fp32 reduction's by about bf16's rounding."""
    fp32 = _run_ranks(_ddp_worker, tmp_path / "fp32", False, "fp32")[0]["flat"]
    res = _run_ranks(_ddp_worker, tmp_path / "bf16", False, "bf16")
    assert all(r["equal"] for r in res)
    rel = float((res[0]["flat"] - fp32).norm() / fp32.norm())
    assert 0 < rel < DRIFT[torch.bfloat16]


# ------------------------------------------------------------------------ the scaler's agreement


def _inf_worker(rank: int, world: int, sharded: bool) -> dict:
    torch.manual_seed(0)
    model = _mlp()
    mp = autoprec.apply(model, Policy.default("fp16"), (torch.randn(4, 8),), compile=False)
    module = shard(mp) if sharded else ddp(mp)
    opt = torch.optim.SGD(module.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    applied, scales = [], []
    for k in range(4):
        g = torch.Generator().manual_seed(100 + k * world + rank)
        scaler.scale(module(torch.randn(4, 8, generator=g)).pow(2).mean()).backward()
        if k == 1 and rank == 1:  # after DDP's all-reduce / FSDP2's reduce-scatter: this rank only
            grad = next(model.parameters()).grad
            (grad.to_local() if sharded else grad).view(-1)[0] = math.inf
        applied.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    flat = torch.cat([p.detach().full_tensor().flatten() if sharded else p.detach().flatten()
                      for p in model.parameters()])
    return {"applied": applied, "scales": scales, "skipped": scaler.skipped_steps,
            "equal": all(torch.equal(flat, other) for other in _gathered(flat))}


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp2"])
def test_inf_on_one_rank_makes_every_rank_skip_and_back_off(tmp_path, sharded):
    """An inf written into rank 1's gradient after the reduction: both ranks skip step 1 and halve
    the scale (DDP: by the scaler's all-reduce; FSDP2: DTensor's dispatch of the unscale kernel
    also reduces found_inf over the mesh, torch/distributed/tensor/_dispatch.py)."""
    r0, r1 = _run_ranks(_inf_worker, tmp_path, sharded)
    assert r0["applied"] == r1["applied"] == [True, False, True, True]
    assert r0["scales"] == r1["scales"] == [1024.0, 512.0, 512.0, 512.0]
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["equal"] and r1["equal"]


def _misuse_worker(rank: int, world: int) -> dict:
    """Each wrong order of apply and a data-parallel wrapper, and the error it gives."""
    from torch.distributed.fsdp import fully_shard

    def error(make):
        try:
            make()
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"
        return None

    x = torch.randn(4, 8)
    policy = Policy.default("bf16")
    out = {"ddp_then_apply": error(lambda: autoprec.apply(nn.parallel.DistributedDataParallel(_mlp()), policy,
                                                          (x,), compile=False)),
           "ddp_of_plain": error(lambda: ddp(_mlp())), "shard_of_plain": error(lambda: shard(_mlp()))}
    sharded = _mlp()
    fully_shard(sharded)
    out["fully_shard_then_apply"] = error(lambda: autoprec.apply(sharded, policy, (x,), compile=False))
    mp = autoprec.apply(_mlp(), policy, (x,), compile=False, dynamic=False)
    fully_shard(mp)
    out["fully_shard_after_apply"] = error(lambda: mp(x))
    return out


@pytest.mark.heavy
def test_data_parallel_wrappers_in_the_wrong_order_are_refused_naming_the_order(tmp_path):
    """fully_shard straight over the applied module trained wrong without a word (losses 4.64 vs
    4.48 on step 1); DDP or FSDP2 before apply failed with torch.export's empty message; ddp()
    and shard() of a plain module with an AttributeError. Each now says what to do."""
    (r,) = _run_ranks(_misuse_worker, tmp_path, world=1)
    for key, wrapper in (("ddp_then_apply", "DistributedDataParallel"),
                         ("fully_shard_then_apply", "fully_shard (FSDP2)")):
        assert r[key].startswith("CaptureError: apply: the model (")
        assert f"already wrapped by {wrapper}" in r[key]
        assert "autoprec.ddp(mp)" in r[key] and "autoprec.shard(mp)" in r[key]
    for key, fn in (("ddp_of_plain", "ddp"), ("shard_of_plain", "shard")):
        assert r[key] == (f"AutoprecError: {fn}: expects the module autoprec.apply returned, got Sequential: "
                          f"mp = autoprec.apply(model, policy, example_batch), then autoprec.{fn}(mp)")
    wrong = r["fully_shard_after_apply"]
    assert wrong.startswith("ValueError: MixedPrecisionModule of Sequential was wrapped by fully_shard")
    assert "autoprec.shard(mp)" in wrong


def test_any_rank_without_process_group_is_the_flag():
    assert any_rank(True) is True and any_rank(False) is False


# --------------------------------------------------------------------------------------- FSDP2


def _fsdp_worker(rank: int, world: int, compile: bool, reduce: str) -> dict:
    torch.manual_seed(0)
    model = _mlp()
    # compiled with emulated casts (as tune compiles and records): the one-process reference is eager
    policy = dataclasses.replace(Policy.default("bf16"), grad_reduce_dtype=reduce,
                                 compile_options=REGIONAL_EMULATED)
    root = shard(autoprec.apply(model, policy, (torch.randn(4, 8),), compile=compile, dynamic=False))
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    local = sum(p.to_local().numel() * p.element_size() for p in root.parameters())
    losses = []
    for k in range(6):
        g = torch.Generator().manual_seed(100 + k)  # every rank the same global batch of 8 rows
        x = torch.randn(8, 8, generator=g)[rank * 4:(rank + 1) * 4]
        loss = root(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(float(loss))
    state = sum(t.to_local().numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.distributed.tensor.DTensor))
    grads = sum(p.grad.to_local().numel() * p.grad.element_size() for p in root.parameters())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    root.eval()  # the model's own forward (fp32) on the Parameters FSDP2 unshards for the call
    with torch.no_grad():
        evaluated = root(x)
        ref = _mlp()
        ref.load_state_dict(full)
        evaluated_ref = ref(x)
    return {"losses": losses, "eval": evaluated, "eval_ref": evaluated_ref,
            "eval_flags": (root.training, root.applied.training, model.training),
            "flat": torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]),
            "param_bytes": local, "grad_bytes": grads, "state_bytes": state, "keys": list(root.state_dict())}


def _single_process_reference(steps: int = 6) -> torch.Tensor:
    torch.manual_seed(0)
    model = _mlp()
    mp = autoprec.apply(model, Policy.default("bf16"), (torch.randn(4, 8),), compile=False, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in range(steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + k))
        ((mp(x[:4]).pow(2).mean() + mp(x[4:]).pow(2).mean()) / 2).backward()
        opt.step()
        opt.zero_grad()
    return _flat_params(model)


@pytest.mark.heavy
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fsdp2_trains_like_one_process(tmp_path, compile):
    """FSDP2 over the applied module (:func:`autoprec.distributed.wrap.shard`) on 2 gloo ranks
    ends where one process ends on the same 8 rows (averaged half-batch gradients); in eval mode
    the sharded root evaluates with the model's own fp32 forward."""
    r0, r1 = _run_ranks(_fsdp_worker, tmp_path, compile, "fp32")
    torch.testing.assert_close(r0["flat"], r1["flat"], rtol=0, atol=0)
    # root.eval() reaches the applied module: its calls are the model's fp32 forward
    assert r0["eval_flags"] == (False, False, False)
    torch.testing.assert_close(r0["eval"], r0["eval_ref"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r0["flat"], _single_process_reference(), rtol=DRIFT[torch.float32], atol=1e-6)
    assert r0["losses"][-1] < r0["losses"][0]


@pytest.mark.heavy
def test_fsdp2_bf16_reduction_and_sharded_memory(tmp_path):
    """``grad_reduce_dtype: bf16`` is FSDP2's ``reduce_dtype`` (trains, drifts little from fp32
    reduction); each rank holds 1/2 of the fp32 weights, gradients and AdamW moments
    (docs/architecture.md#runtime, "Memory under sharding": 4 + 4 + 8 bytes per parameter / N)."""
    fp32 = _run_ranks(_fsdp_worker, tmp_path / "fp32", False, "fp32")
    bf16 = _run_ranks(_fsdp_worker, tmp_path / "bf16", False, "bf16")
    rel = float((bf16[0]["flat"] - fp32[0]["flat"]).norm() / fp32[0]["flat"].norm())
    assert 0 < rel < DRIFT[torch.bfloat16]
    n_params = sum(p.numel() for p in _mlp().parameters())  # 484, even per layer: no padding
    for r in fp32:
        assert r["param_bytes"] == r["grad_bytes"] == 4 * n_params // WORLD
        assert r["state_bytes"] == 8 * n_params // WORLD
        assert all(k.startswith("model.") for k in r["keys"])


# --------------------------------------------------------------------------- autoprec train --nproc


def test_train_nproc_2_matches_one_rank_at_twice_the_batch(tmp_path, capfd):
    """``autoprec train --nproc 2`` (torchrun, DDP, rank r at step k on get_batch(2k + r)) logs the
    loss curve one process logs on the concatenated 2B batches, within fp32 tolerance, 20 steps."""
    policy = tmp_path / "fp32.json"
    Policy.fp32().save(policy)
    log = tmp_path / "log.jsonl"
    code = main(["train", str(MODELS / "ddp_mlp.py"), "--policy", str(policy), "--steps", "20",
                 "--no-compile", "--device", "cpu", "--nproc", "2", "--log", str(log), "--log-every", "10"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert out.count("step   10") == 1  # rank 0 prints, rank 1 does not
    assert ("2 ranks: a step's loss is the mean over the ranks, its seconds the slowest rank's, tokens/s all "
            "the ranks' tokens over those seconds") in out and " tokens/s across 2 ranks; " in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    two = [r["loss"] for r in records]
    one = train(MODELS / "ddp_mlp_2b.py", policy, steps=20, device="cpu", compile=False, quiet=True).losses
    assert len(two) == len(one) == 20
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=DRIFT[torch.float32], atol=1e-7)
    assert sum(one[-5:]) < sum(one[:5])
    # tokens/s is the job's: both ranks' 4 examples a step (ddp_mlp counts examples), not rank 0's 4
    assert [round(r["tokens_per_s"] * r["seconds"], 6) for r in records] == [8.0] * 20


def test_train_nproc_2_batching_is_per_rank_and_says_so(tmp_path, capfd):
    """Under --nproc 2 each rank trains the policy's whole global batch (micro-batch 4 x 2 = 8), so a
    step covers 16 examples: the header says so (it said "global batch 8"), the logged tokens are 16 a
    step, and the losses are one process's at micro-batch 4 x 4 (the same 16 examples a step)."""
    per_rank, both = tmp_path / "4x2.json", tmp_path / "4x4.json"
    dataclasses.replace(Policy.fp32(), batching=Batching(micro_batch=4, accumulation=2)).save(per_rank)
    dataclasses.replace(Policy.fp32(), batching=Batching(micro_batch=4, accumulation=4)).save(both)
    log = tmp_path / "log.jsonl"
    code = main(["train", str(MODELS / "ddp_mlp.py"), "--policy", str(per_rank), "--steps", "3",
                 "--no-compile", "--device", "cpu", "--nproc", "2", "--log", str(log)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert ("training at micro-batch 4 x 2 accumulated per rank (8 per rank, 16 across 2 ranks) "
            "(the policy's batching)") in out.splitlines()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [round(r["tokens_per_s"] * r["seconds"], 6) for r in records] == [16.0] * 3
    one = train(MODELS / "ddp_mlp.py", both, steps=3, device="cpu", compile=False, quiet=True).losses
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor(one),
                               rtol=DRIFT[torch.float32], atol=1e-7)


def test_train_nproc_refuses_compare(tmp_path, capsys):
    policy = tmp_path / "p.json"
    Policy.fp32().save(policy)
    code = main(["train", str(MODELS / "ddp_mlp.py"), "--policy", str(policy), "--nproc", "2", "--compare",
                 "fp32"])
    assert code == 2 and "--compare" in capsys.readouterr().err


def test_strip_nproc():
    assert strip_nproc(["train", "m.py", "--nproc", "2", "--steps", "3"]) == ["train", "m.py", "--steps", "3"]
    assert strip_nproc(["train", "--nproc=4", "m.py"]) == ["train", "m.py"]


# ------------------------------------------------------------------------ policy: grad_reduce_dtype


def test_grad_reduce_dtype_round_trips_and_old_files_load(tmp_path):
    p = dataclasses.replace(Policy.default("bf16"), grad_reduce_dtype="bf16")
    p.save(tmp_path / "p.json")
    loaded = Policy.load(tmp_path / "p.json")
    assert loaded == p and loaded.grad_reduce_dtype == "bf16"
    assert json.loads((tmp_path / "p.json").read_text())["schema_version"] == 1
    old = {"schema_version": 1, "default_dtype": "bf16"}  # a file from before the field
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Policy.load(tmp_path / "old.json").grad_reduce_dtype == "fp32"
    assert "grad_reduce_dtype" not in Policy.default().to_dict()  # fp32 is not written: same training_key
    assert p.training_key() != Policy.default("bf16").training_key()


def test_grad_reduce_dtype_invalid_names_file_and_field(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"schema_version": 1, "grad_reduce_dtype": "fp16"}))
    with pytest.raises(PolicyError, match=rf"{f}: grad_reduce_dtype: 'fp16' is not a valid .*fp32, bf16"):
        Policy.load(f)


def test_env_is_clean():
    """The tests above start ranks in child processes only: this process never joined a group."""
    assert not dist.is_initialized() and "RANK" not in os.environ


# ------------------------------------------------------------------- checkpoints of a sharded run


def _fsdp_ckpt_worker(rank: int, world: int, path: str, resume: bool) -> dict:
    """6 steps of a sharded fp16 run with dropout (loss scaler; each rank its own random stream),
    saved by every rank after 3 and after 4 steps, each save read back at once on every rank; or,
    with ``resume``, a fresh sharded run that loads the checkpoint on every rank and does steps 4..5."""
    from autoprec.training.checkpoint import peek_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    policy = Policy.default("fp16")
    root = shard(autoprec.apply(model, policy, (torch.randn(4, 8),), compile=False, dynamic=False))
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    scaler = autoprec.make_scaler(policy)
    torch.manual_seed(1000 + rank)  # dropout masks differ per rank, as in any data-parallel run
    start = autoprec.load_checkpoint(path, root, opt, scaler).step if resume else 0
    losses, seen = {}, []
    for k in range(start, 6):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + k))[rank * 4:(rank + 1) * 4]
        loss = root(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses[k] = float(loss)
        if k in (2, 3) and not resume:
            autoprec.save_checkpoint(path, root, opt, scaler, policy, step=k + 1)  # a collective: every rank
            seen.append(peek_checkpoint(path).step)  # the file just written, on every rank
    flat = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return {"losses": losses, "flat": flat, "seen": seen}


@pytest.mark.heavy
def test_a_sharded_run_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path):
    """A user test saved an ``autoprec.shard`` run on rank 0 and resumed: the file held rank 0's
    shards only (DTensors), loading raised nothing, and the resumed losses were wrong (4.679 against
    4.554). ``save_checkpoint`` now gathers the full state (torch.distributed.checkpoint's
    ``get_state_dict``, rank 0 writes it) and ``load_checkpoint`` gives each rank its shards: the
    resumed steps equal the uninterrupted ones, and the file loads into the plain model too."""
    ckpt = tmp_path / "ckpt.pt"
    whole = _run_ranks(_fsdp_ckpt_worker, tmp_path / "whole", str(ckpt), False)
    resumed = _run_ranks(_fsdp_ckpt_worker, tmp_path / "resumed", str(ckpt), True)
    assert whole[0]["losses"] != whole[1]["losses"]
    for r in range(WORLD):
        # a save returns once the file is written: read at once, every rank sees it (rank 1 read the
        # one before, a user test)
        assert whole[r]["seen"] == [3, 4], whole[r]["seen"]
        assert list(resumed[r]["losses"]) == [4, 5]
        # each rank's own random stream restored (rank 0's on every rank drew other dropout masks)
        assert resumed[r]["losses"] == {k: whole[r]["losses"][k] for k in (4, 5)}, (whole[r], resumed[r])
        torch.testing.assert_close(resumed[r]["flat"], whole[r]["flat"], rtol=0, atol=0)
    payload = torch.load(ckpt, weights_only=True)
    assert len(payload["rng_ranks"]) == WORLD
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    assert set(payload["model"]) == set(plain.state_dict())  # the model's own keys, full tensors
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ck = autoprec.load_checkpoint(ckpt, plain, opt)
    assert ck.step == 4 and all(len(s) == 3 for s in opt.state.values()) and len(opt.state) == 4


def _ddp_ckpt_worker(rank: int, world: int, path: str) -> dict:
    """Two DDP steps of a bf16 policy, saved on rank 0 through the DDP module :func:`ddp` returned;
    then a fresh DDP run of other initial weights loads it through its own DDP module."""
    torch.manual_seed(0)
    model = _mlp()
    mp = autoprec.apply(model, Policy.default("bf16"), (torch.randn(4, 8),), compile=False)
    module = ddp(mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + k * world + rank))
        module(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dcp_keys = sorted(get_state_dict(module, opt)[0])  # PyTorch's own helper walks the names too
    if rank == 0:
        autoprec.save_checkpoint(path, module, opt, policy=mp.policy, step=2)
    dist.barrier()
    torch.manual_seed(1)
    fresh = _mlp()
    module2 = ddp(autoprec.apply(fresh, Policy.default("bf16"), (torch.randn(4, 8),), compile=False))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    step = autoprec.load_checkpoint(path, module2, opt2).step
    return {"step": step, "same": torch.equal(_flat_params(fresh), _flat_params(model)),
            "opt_steps": [float(s["step"]) for s in opt2.state.values()], "dcp_keys": dcp_keys}


def test_a_ddp_run_saves_and_loads_through_the_module_ddp_returned(tmp_path):
    """A user saved ``autoprec.ddp(mp)`` with ``save_checkpoint`` and resumed with ``load_checkpoint``
    into the same kind of module: "Unexpected key(s) in state_dict: module.transformer.wte.weight",
    and the file did not load into the plain model either. Both now take the module's own keys.
    torch.distributed.checkpoint's ``get_state_dict`` of that module raised AttributeError
    ('MixedPrecisionModule' object has no attribute 'transformer'); it gives the model's keys."""
    ckpt = tmp_path / "ddp.pt"
    res = _run_ranks(_ddp_ckpt_worker, tmp_path / "run", str(ckpt))
    plain = _mlp()
    for r in res:
        assert r["step"] == 2 and r["same"] and r["opt_steps"] == [2.0] * 6, r
        assert r["dcp_keys"] == sorted(plain.state_dict())  # get_state_dict raised AttributeError
    assert set(torch.load(ckpt, weights_only=True)["model"]) == set(plain.state_dict())  # no "module."
    assert autoprec.load_checkpoint(ckpt, plain).step == 2
