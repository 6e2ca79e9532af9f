"""`ZeroStrategy`: a Lightning strategy that trains with a `ZeroOptimizer` (stages 1-3) instead of
DDP, for ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``, whichever is installed.

    import zero_kernels.integrations.lightning  # registers zero_kernels_stage_1/2/3
    trainer = L.Trainer(strategy="zero_kernels_stage_3", devices=2, gradient_clip_val=1.0)

``ZeroStrategy(stage=2, **zero_kwargs)``: ``zero_kwargs`` are `ZeroOptimizer`'s options
(``bucket_size_mb``, ``policy``, ``reduce_dtype``, ...), checked by name at construction.

[Note: the Lightning strategy]
Lightning's loop stays as it is; the strategy swaps the parts DDP would play:

- model: not wrapped in DDP (a DDP over a ZeroOptimizer's params is an error) but in `_ZeroModule`,
  a thin module whose forward calls the LightningModule. Lightning's forward redirection runs
  ``training_step``/``validation_step`` inside that forward, so at stage 3 the root unit is
  gathered around the whole step (the LightningModule's own ``self(x)`` inside it is a nested
  call of a child, which stage 3 handles; hooks on the LightningModule itself would have made
  ``self(x)`` a second root forward inside the first).
- optimizer: ``configure_optimizers`` returns a plain torch optimizer (one; its schedulers
  too); `setup_optimizers` turns it into a `ZeroOptimizer` of the same class over the same
  param groups (`from_torch_optimizer`) and points the schedulers at it. The plain one never
  steps. A ZeroOptimizer returned by the user is refused (its hooks would sit on the
  LightningModule, see above).
- backward and accumulation: the optimizer reduces the gradients in its own backward hooks;
  Lightning's ``block_backward_sync`` (micro-batches before the last of
  ``accumulate_grad_batches``) is ``opt.no_sync()``. Lightning divides the loss by the number of
  micro-batches, as with DDP.
- clipping: the precision plugin's ``clip_grad_by_norm`` is pointed at ``opt.clip_grad_norm_``
  (the global norm over the shards, DDP's result), so ``gradient_clip_val`` and a
  ``configure_gradient_clipping`` that calls ``self.clip_gradients`` both use it;
  ``gradient_clip_algorithm="value"`` runs torch's ``clip_grad_value_``, element-wise on each
  rank's pieces of the averaged gradient (DDP's values; [Note: gradients] in
  `zero_kernels.partition.grads`).
- stage 3 refuses the weight-averaging callbacks (``WeightAveraging``/``EMAWeightAveraging``,
  ``StochasticWeightAveraging``) at fit: they read and copy the params between steps, where
  stage 3 leaves NaN placeholders (reads were NaN, the in-place copy failed in torch).
- checkpoints: ``trainer.save_checkpoint(path)`` (and `ModelCheckpoint`) make ``path`` a
  directory: `zero_kernels.save_checkpoint` writes the model and optimizer there (collective,
  every rank writes its pieces; ``keep_last=1``: a path saved again is replaced), and rank 0
  writes the rest of Lightning's checkpoint dict (epoch, global step, loops, callbacks,
  schedulers, precision plugin, hyper-parameters, the user's ``on_save_checkpoint`` keys) as
  ``path/lightning-<id>.pt`` *before* it; the zero_kernels checkpoint's ``extra`` names that file,
  so a save killed at any point leaves the previous pair loadable. ``state_dict`` and
  ``optimizer_states`` are left out of Lightning's dict (at stage 3 ``state_dict()`` gathers the
  whole model on every rank). ``restore_checkpoint_after_setup`` is True and
  ``lightning_restore_optimizer`` False: ``trainer.fit(ckpt_path=path)`` builds the optimizer
  first, then `load_checkpoint` fills model, optimizer and RNG states on every rank (any world
  size or stage), and Lightning restores the rest from the side file.
- precision: ``32-true``, ``64-true``, ``bf16-true``/``16-true`` (the ZeroOptimizer keeps fp32
  masters of the half params) and ``bf16-mixed``/``16-mixed`` (autocast; the GradScaler's inf
  check is agreed by every rank). FSDP/DeepSpeed/XLA/bitsandbytes/TransformerEngine plugins
  raise.
- after ``fit`` the ZeroOptimizer stays alive (``trainer.test`` and ``save_checkpoint`` still
  work; at stage 3 the params stay sharded and ``model.state_dict()`` is collective); the next
  ``fit`` closes it (collective) before building a new one, as Lightning builds new optimizers,
  and so does another trainer's ``ZeroStrategy`` set up on the same LightningModule.
  ``ZeroStrategy.close()`` hands the params back whole at any time.

- manual optimization (``automatic_optimization = False``): ``self.optimizers()`` is the
  ZeroOptimizer behind Lightning's wrapper; ``manual_backward`` reduces in the optimizer's hooks
  (and scales the loss where it keeps a loss scale), ``self.clip_gradients`` clips through
  ``opt.clip_grad_norm_`` as above, ``opt.step()``/``opt.zero_grad()`` and the schedulers are
  the user's, and gradients accumulate across backwards until ``zero_grad`` (DDP's values,
  stages 1-3, tests/integrations/lightning_checks.py). At stage 3 the training step runs inside the
  root's forward (see the model above) and ``opt.step()`` reshards the root unit: a call of a module
  whose params are in the root unit after the step, inside the same training step, raises
  (units are gathered again by their own forward, with the stepped values).

Not supported (each raises, naming the setting): several optimizers, a
custom ``CheckpointIO``, ``ckpt_path`` outside ``fit`` without a live optimizer, a ``.ckpt``
file from another strategy.
"""

from __future__ import annotations

import functools
import importlib
import io
import logging
import os
import shutil
import uuid
import weakref
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .common import from_torch_optimizer, is_zero, shard_of, zero_kwargs

__all__ = ["ZeroStrategy", "PyTorchLightningZeroStrategy", "strategy_class"]

log = logging.getLogger(__name__)

# LightningModule -> the strategy whose ZeroOptimizer holds its params (one at a time)
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NAMES = {1: "zero_kernels_stage_1", 2: "zero_kernels_stage_2", 3: "zero_kernels_stage_3"}
_SIDE_PREFIX = "lightning-"  # Lightning's part of a checkpoint: path/lightning-<id>.pt
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default process group timeout


class _ZeroModule(nn.Module):
    """The LightningModule as the one child of a module whose forward calls it: the model the
    ZeroOptimizer hooks (see [Note: the Lightning strategy])."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _track_step(opt) -> None:
    """What an LR scheduler does to the optimizer it is built over (torch's check that
    ``optimizer.step()`` ran before ``scheduler.step()``), done to the ZeroOptimizer the
    scheduler is pointed at instead."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref, step = weakref.ref(opt), type(opt).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        me = ref()
        me._opt_called = True
        return step(me, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _build(pl_name: str, fabric_name: str) -> type:
    """The strategy class of one framework (``lightning.pytorch`` or ``pytorch_lightning``)."""
    m = lambda sub: importlib.import_module(f"{pl_name}.{sub}")  # noqa: E731
    f = lambda sub: importlib.import_module(f"{fabric_name}.{sub}")  # noqa: E731
    ParallelStrategy = m("strategies.parallel").ParallelStrategy
    Launcher = m("strategies.launchers")._SubprocessScriptLauncher
    TrainerFn = m("trainer.states").TrainerFn
    prec = m("plugins.precision")
    TorchCheckpointIO = m("plugins").TorchCheckpointIO
    rank_zero_only = m("utilities.rank_zero").rank_zero_only
    sync_module_states = m("overrides.distributed")._sync_module_states
    fdist = f("utilities.distributed")
    reset_seed = f("utilities.seed").reset_seed
    load_file = f("utilities.cloud_io")._load
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    # the framework's own callback classes (``WeightAveraging`` came in Lightning 2.5)
    callbacks = m("callbacks")
    averaging = tuple(
        getattr(callbacks, n)
        for n in ("WeightAveraging", "StochasticWeightAveraging")
        if hasattr(callbacks, n)
    )

    unsupported = tuple(
        getattr(prec, n)
        for n in (
            "DeepSpeedPrecision",
            "FSDPPrecision",
            "XLAPrecision",
            "BitsandbytesPrecision",
            "TransformerEnginePrecision",
        )
        if hasattr(prec, n)
    )

    class ZeroStrategy(ParallelStrategy):
        """Data-parallel training with a `ZeroOptimizer` of ``stage`` 1, 2 or 3 in place of DDP;
        ``zero_kwargs``: `ZeroOptimizer` options. See [Note: the Lightning strategy] in
        `zero_kernels.integrations.lightning`."""

        strategy_name = "zero_kernels"

        def __init__(
            self,
            stage: int | None = None,
            *,
            accelerator=None,
            parallel_devices=None,
            cluster_environment=None,
            checkpoint_io=None,
            precision_plugin=None,
            process_group_backend: str | None = None,
            timeout: timedelta | None = _DEFAULT_TIMEOUT,
            **zero_options,
        ) -> None:
            where = f"{type(self).__name__}"
            if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3)):
                raise ValueError(f"{where}: stage must be 1, 2 or 3, got stage={stage!r}")
            if stage is not None and "policy" in zero_options:
                raise ValueError(
                    f"{where}: give stage={stage!r} or policy=..., not both (the policy's "
                    "ShardPolicy sets the stage)"
                )
            if "policy" not in zero_options and stage is None:
                stage = 2
            if process_group_backend is not None and not isinstance(process_group_backend, str):
                raise TypeError(
                    f"{where}: process_group_backend must be a str, got "
                    f"process_group_backend={process_group_backend!r}"
                )
            self._zero_options = zero_kwargs(zero_options, where, stage=stage)
            super().__init__(
                accelerator=accelerator,
                parallel_devices=parallel_devices,
                cluster_environment=cluster_environment,
                checkpoint_io=checkpoint_io,
                precision_plugin=precision_plugin,
            )
            self._num_nodes = 1
            self._process_group_backend = process_group_backend
            self._timeout = timeout
            self._zero = None  # the live ZeroOptimizer (see [Note: the Lightning strategy])
            self._wrapper: _ZeroModule | None = None  # the module it hooks
            self._clip_patched = None

        # ------------------------------------------------------------------ topology
        @property
        def stage(self) -> int | None:
            return self._zero_options.get("stage")

        @property
        def zero_options(self) -> dict:
            """The `ZeroOptimizer` keywords this strategy builds with (``stage``, policies)."""
            return dict(self._zero_options)

        @property
        def zero_optimizer(self):
            """The live `ZeroOptimizer` (None before the first ``fit`` and after `close`)."""
            return self._zero

        @property
        def root_device(self) -> torch.device:
            assert self.parallel_devices is not None
            return self.parallel_devices[self.local_rank]

        @property
        def num_nodes(self) -> int:
            return self._num_nodes

        @num_nodes.setter
        def num_nodes(self, num_nodes: int) -> None:
            self._num_nodes = num_nodes

        @property
        def num_processes(self) -> int:
            return len(self.parallel_devices) if self.parallel_devices is not None else 0

        @property
        def is_distributed(self) -> bool:  # the trainer adds a DistributedSampler
            return True

        @property
        def distributed_sampler_kwargs(self) -> dict:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

        @property
        def process_group_backend(self) -> str | None:
            return self._process_group_backend

        def _configure_launcher(self) -> None:
            # as DDP's "popen": the script is started again per local rank, unless a launcher
            # (torchrun, SLURM) started the processes already
            assert self.cluster_environment is not None
            self._launcher = Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

        def set_world_ranks(self) -> None:
            if self.cluster_environment is not None:
                self.cluster_environment.set_global_rank(
                    self.node_rank * self.num_processes + self.local_rank
                )
                self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

        def setup_environment(self) -> None:
            self._check_plugins()
            super().setup_environment()
            reset_seed()
            self.set_world_ranks()
            backend = self._process_group_backend or (
                fdist._get_default_process_group_backend_for_device(self.root_device)
            )
            self._process_group_backend = backend
            kwargs = {"timeout": self._timeout}
            if self.root_device.type != "cpu":
                kwargs["device_id"] = self.root_device
            fdist._init_dist_connection(self.cluster_environment, backend, **kwargs)

        def _check_plugins(self) -> None:
            p = self.precision_plugin
            if isinstance(p, unsupported) or not isinstance(p, prec.Precision):
                raise NotImplementedError(
                    f"{type(self).__name__}: the precision plugin {type(p).__name__} "
                    f"(precision={getattr(p, 'precision', '?')!r}) is not supported; use "
                    "precision='32-true', '64-true', 'bf16-true', '16-true', 'bf16-mixed' or "
                    "'16-mixed'"
                )
            cio = self._checkpoint_io
            if cio is not None and type(cio) is not TorchCheckpointIO:
                raise NotImplementedError(
                    f"{type(self).__name__}: checkpoint_io={type(cio).__name__} is not "
                    "supported: checkpoints go through zero_kernels.save_checkpoint (a directory "
                    "per checkpoint, every rank writing its pieces)"
                )

        # ------------------------------------------------------------------ setup
        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        def setup(self, trainer) -> None:
            assert self.accelerator is not None and self.model is not None
            self.accelerator.setup(trainer)
            fitting = trainer.state.fn == TrainerFn.FITTING
            lm = self.lightning_module
            if fitting:
                self._check_fit(trainer, lm)
            prev = _LIVE.get(lm)
            prev = prev() if prev is not None else None
            if prev is not None and prev is not self:  # another trainer's optimizer on it
                prev.close()
            _LIVE[lm] = weakref.ref(self)
            if self._wrapper is not None and self._wrapper.module is not lm:
                self.close()  # this strategy's optimizer was on another module
                self._wrapper = None
            if self._zero is None:  # no live sharded params: the model is a plain module
                if fitting and self._layer_sync:
                    self._layer_sync.apply(lm)
                self.precision_plugin.convert_module(lm)
                lm.to(self.root_device)
                sync_module_states(lm)  # as DDP: rank 0's values everywhere
            if self._wrapper is None:  # one per module: the live ZeroOptimizer's hooks are on it
                self._wrapper = _ZeroModule(lm)
            self.model = self._wrapper
            if fitting:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()

        def _check_fit(self, trainer, lm) -> None:
            name = type(self).__name__
            if not shard_of(self._zero_options).params:  # stage 3
                for cb in trainer.callbacks:
                    if isinstance(cb, averaging):
                        raise NotImplementedError(
                            f"{name}: the {type(cb).__name__} callback at stage 3: it reads and "
                            "writes the model's params between steps, where stage 3 holds "
                            "them sharded (they read as NaN placeholders, and its in-place "
                            "copy failed with torch's 'more than one element ... refers to "
                            "a single memory location'); use stage 1 or 2 with it"
                        )

        def setup_optimizers(self, trainer) -> None:
            """``configure_optimizers``'s plain optimizer turned into a `ZeroOptimizer`; the
            schedulers are pointed at it."""
            name = type(self).__name__
            if self._zero is not None:  # a previous fit's: its hooks would stay on the model
                self.close()
            super().setup_optimizers(trainer)
            opts = self.optimizers
            if len(opts) != 1:
                raise NotImplementedError(
                    f"{name}: configure_optimizers must return exactly one optimizer, got "
                    f"{len(opts)} ({', '.join(type(o).__name__ for o in opts) or 'none'})"
                )
            plain = opts[0]
            if type(plain).__name__ == "_MockOptimizer":  # Lightning's stand-in for None
                raise ValueError(
                    f"{name}: configure_optimizers returned no optimizer; return the torch "
                    "optimizer the ZeroOptimizer is to be built from"
                )
            if is_zero(plain):
                raise TypeError(
                    f"{name}: configure_optimizers returned a ZeroOptimizer; return the plain "
                    "torch optimizer (e.g. torch.optim.AdamW(self.parameters(), ...)): the "
                    "strategy builds the ZeroOptimizer with the options given to it"
                )
            zero = from_torch_optimizer(self.model, plain, dict(self._zero_options), name)
            for cfg in self.lr_scheduler_configs:
                sched = cfg.scheduler
                if getattr(sched, "optimizer", None) is not plain:
                    raise ValueError(
                        f"{name}: the scheduler {type(sched).__name__} does not hold the "
                        "optimizer configure_optimizers returned"
                    )
                sched.optimizer = zero
                _track_step(zero)
            self._zero = zero
            self.optimizers = [zero]

        def setup_precision_plugin(self) -> None:
            super().setup_precision_plugin()
            self._patch_clipping()

        def _patch_clipping(self) -> None:
            """The precision plugin's clipping by norm on our optimizer: ``opt.clip_grad_norm_``
            (see [Note: the Lightning strategy]); by value it is Lightning's own
            ``clip_grad_value_`` over the ShardedGrads."""
            p = self.precision_plugin
            if self._clip_patched is p:
                return
            by_norm = p.clip_grad_by_norm

            def clip_grad_by_norm(optimizer, clip_val):
                opt = getattr(optimizer, "_optimizer", optimizer)
                if is_zero(opt):
                    return opt.clip_grad_norm_(float(clip_val))
                return by_norm(optimizer, clip_val)

            p.clip_grad_by_norm = clip_grad_by_norm
            self._clip_patched = p

        # ------------------------------------------------------------------ training
        def backward(self, closure_loss, optimizer, *args, **kwargs):
            if self._zero is not None:  # identity unless the ZeroOptimizer scales the loss
                closure_loss = self._zero.scale_loss(closure_loss)
            return super().backward(closure_loss, optimizer, *args, **kwargs)

        @contextmanager
        def block_backward_sync(self):
            """Micro-batches before the last of ``accumulate_grad_batches``."""
            if self._zero is None:
                yield None
            else:
                with self._zero.no_sync():
                    yield None

        def reduce(self, tensor, group=None, reduce_op="mean"):
            if isinstance(tensor, torch.Tensor):
                return fdist._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
            return tensor

        def barrier(self, *args, **kwargs) -> None:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

        def broadcast(self, obj, src: int = 0):
            if not (dist.is_available() and dist.is_initialized()):
                return obj
            box = [obj]
            dist.broadcast_object_list(box, src)
            return box[0]

        # ------------------------------------------------------------------ checkpoints
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

        @property
        def lightning_restore_optimizer(self) -> bool:
            return False

        def lightning_module_state_dict(self) -> dict:
            return {}  # the params are saved by zero_kernels.save_checkpoint

        def optimizer_state(self, optimizer) -> dict:
            return {}  # likewise the optimizer state

        def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
            """``filepath`` as a checkpoint directory (collective; see [Note: the Lightning
            strategy])."""
            from ..checkpoint import save_checkpoint
            from ..checkpoint.format import write_file_atomic

            name = type(self).__name__
            if storage_options is not None:
                raise TypeError(
                    f"{name}.save_checkpoint: storage_options={storage_options!r} is not "
                    "supported (checkpoints are zero_kernels directories)"
                )
            opt = self._require_zero("save_checkpoint")
            root = os.path.abspath(os.fspath(filepath))
            if os.path.isfile(root):
                raise ValueError(
                    f"{name}.save_checkpoint: {root!r} is a file; a ZeroStrategy checkpoint is "
                    "a directory"
                )
            side = {
                k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
            }
            side_name = self.broadcast(f"{_SIDE_PREFIX}{uuid.uuid4().hex[:12]}.pt")
            if self.is_global_zero:
                os.makedirs(root, exist_ok=True)
                buf = io.BytesIO()
                torch.save(side, buf)
                write_file_atomic(os.path.join(root, side_name), buf.getvalue())
            extra = {
                "step": int(checkpoint.get("global_step", opt.sharded_state.steps)),
                "epoch": int(checkpoint.get("epoch", 0)),
                "lightning_state": side_name,
            }
            save_checkpoint(root, self.lightning_module, opt, extra=extra, keep_last=1)
            if self.is_global_zero:  # the replaced checkpoints' side files
                for n in os.listdir(root):
                    if n.startswith(_SIDE_PREFIX) and n != side_name:
                        os.remove(os.path.join(root, n))

        def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
            """Model, optimizer and RNG states into the live ZeroOptimizer (collective); returns
            the rest of Lightning's checkpoint dict."""
            from ..checkpoint import CheckpointError, load_checkpoint

            name = type(self).__name__
            path = os.path.abspath(os.fspath(checkpoint_path))
            if not os.path.isdir(path):
                raise ValueError(
                    f"{name}: ckpt_path={os.fspath(checkpoint_path)!r} is not a directory written "
                    f"by {name}.save_checkpoint (a .ckpt file of another strategy cannot be "
                    "loaded here; load its state_dict into the model before fit instead)"
                )
            opt = self._require_zero(f"load_checkpoint(ckpt_path={os.fspath(checkpoint_path)!r})")
            extra = load_checkpoint(path, self.lightning_module, opt)
            side_name = extra.get("lightning_state")
            side_path = os.path.join(path, str(side_name))
            if not side_name or not os.path.isfile(side_path):
                raise CheckpointError(
                    side_path, f"missing: the Lightning state this checkpoint names ({side_name!r})"
                )
            return load_file(side_path, map_location="cpu", weights_only=weights_only)

        def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
            pass  # loaded by load_checkpoint

        def load_optimizer_state_dict(self, checkpoint) -> None:
            pass  # likewise

        def remove_checkpoint(self, filepath) -> None:
            if self.is_global_zero:
                p = os.fspath(filepath)
                if os.path.isdir(p):
                    shutil.rmtree(p)
                elif os.path.exists(p):
                    os.remove(p)

        def _require_zero(self, what: str):
            if self._zero is None:
                raise RuntimeError(
                    f"{type(self).__name__}.{what}: there is no ZeroOptimizer (it is built in "
                    "trainer.fit, and kept until the next fit or close()); checkpoints are "
                    "saved and loaded within fit"
                )
            return self._zero

        # ------------------------------------------------------------------ teardown
        def close(self) -> None:
            """Close the ZeroOptimizer (collective at stage 3): its hooks removed, the params
            whole plain tensors again; the strategy can fit again after."""
            if self._zero is not None:
                opt, self._zero = self._zero, None
                opt.close()
                self.optimizers = []

        def teardown(self) -> None:
            # Strategy.teardown would move the model and the optimizer to the CPU: the live
            # ZeroOptimizer's params are views of its buffers, so they stay where they are
            self.precision_plugin.teardown()
            assert self.accelerator is not None and self.cluster_environment is not None
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            self.cluster_environment.teardown()
            if self._zero is None and isinstance(self.model, _ZeroModule):
                self.model = self.lightning_module

    ZeroStrategy.__module__ = __name__
    return ZeroStrategy


def _register(cls: type, pl_name: str) -> None:
    reg = importlib.import_module(f"{pl_name}.strategies").StrategyRegistry
    for stage, name in _NAMES.items():
        reg.register(
            name,
            cls,
            description=f"zero_kernels ZeroOptimizer, stage {stage}",
            override=True,
            stage=stage,
        )


_classes: dict[str, type] = {}
for _pl, _fabric in (
    ("lightning.pytorch", "lightning.fabric"),
    ("pytorch_lightning", "lightning_fabric"),
):
    if _import(_pl) is not None and _import(_fabric) is not None:
        _classes[_pl] = _build(_pl, _fabric)
        _register(_classes[_pl], _pl)

if not _classes:
    raise ImportError(
        "zero_kernels.integrations.lightning needs lightning or pytorch_lightning: "
        "pip install 'zero_kernels[lightning]' (or pip install lightning)"
    )

#: the strategy for ``lightning.pytorch`` where it is installed, else for ``pytorch_lightning``
ZeroStrategy = _classes.get("lightning.pytorch") or _classes["pytorch_lightning"]
#: the strategy for ``pytorch_lightning`` (the same class where only it is installed)
PyTorchLightningZeroStrategy = _classes.get("pytorch_lightning", ZeroStrategy)
ZeroStrategy.__qualname__ = ZeroStrategy.__name__ = "ZeroStrategy"
if PyTorchLightningZeroStrategy is not ZeroStrategy:
    PyTorchLightningZeroStrategy.__qualname__ = "PyTorchLightningZeroStrategy"
    PyTorchLightningZeroStrategy.__name__ = "PyTorchLightningZeroStrategy"


def strategy_class(framework: str = "lightning") -> type:
    """The strategy class for ``framework``: "lightning" (``lightning.pytorch``) or
    "pytorch_lightning"."""
    key = {"lightning": "lightning.pytorch", "lightning.pytorch": "lightning.pytorch"}.get(
        framework, framework
    )
    if key not in ("lightning.pytorch", "pytorch_lightning"):
        raise ValueError(
            f"framework must be 'lightning' or 'pytorch_lightning', got framework={framework!r}"
        )
    if key not in _classes:
        raise ImportError(f"strategy_class(framework={framework!r}): {key} is not installed")
    return _classes[key]
