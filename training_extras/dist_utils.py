"""Distributed training / testing on machines without a GPU (gloo), for mmengine 0.10.

``tools/dist_train.sh CONFIG N`` starts N processes with torchrun and mmengine's Runner then sets
up data-parallel training. On a CPU-only machine mmengine 0.10.7 fails in three places:

1. ``mmengine.dist.init_dist`` (``_init_dist_pytorch`` / ``_init_dist_slurm`` / ``_init_dist_mpi``)
   always calls ``torch.cuda.set_device`` and the configs ask for the ``nccl`` backend.
   -> :func:`init_cpu_dist` initialises the default process group with ``gloo`` itself, from the
   launcher's environment; the Runner sees an initialised group and skips its own set-up.
2. ``Runner.wrap_model`` passes ``device_ids=[LOCAL_RANK]`` to ``MMDistributedDataParallel``,
   which torch rejects for a module on the CPU.
   -> :class:`CPUDistributedDataParallel` drops ``device_ids`` / ``output_device``.
3. ``torch.nn.SyncBatchNorm`` only runs on GPU tensors, and mmengine reverts SyncBN to BN only in
   non-distributed runs (the XCiT configs use SyncBN in the backbone, and mmseg heads use it too).
   -> :class:`CPUDistributedDataParallel` reverts SyncBN (torch's and mmcv's) to BatchNorm with
   ``mmengine.model.revert_sync_batchnorm`` before wrapping; parameters keep their identity, so
   optimizers and checkpoints are unaffected. Batch statistics are then per process, as with
   plain BN on one machine.

:func:`prepare_cpu_distributed_cfg` switches a config to these pieces and :func:`init_distributed`
is the single entry point the tools call, through :func:`distributed_session`, which also destroys
the process group when the tool is done: a gloo process left to the interpreter's exit can abort
(``terminate called without an active exception``, SIGABRT) while its worker threads still hold
tensors, which turns a finished ``tools/dist_test.sh`` into a failed one. On machines with CUDA
nothing here changes mmengine's behaviour: :func:`init_distributed` just calls
``mmengine.dist.init_dist`` early.
"""
import contextlib
import datetime
import gc
import os
import re
import subprocess
import sys
import traceback
from typing import Optional

import torch
import torch.distributed as torch_dist
from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
from mmengine.registry import MODEL_WRAPPERS

CPU_DDP_TYPE = 'CPUDistributedDataParallel'

# How long a gloo collective waits for the other ranks before failing (env_cfg.dist_cfg.timeout,
# seconds). torch's default for gloo; set explicitly so that it is stated in the log and in the
# error a rank gives when another one hangs. Longer than any work one rank does alone while the
# others wait (rank 0 computing COCO metrics, writing a checkpoint).
DEFAULT_GLOO_TIMEOUT_S = 1800

# Texts of gloo / c10d errors that mean another rank is gone or stuck.
_LOST_PEER = ('Connection reset by peer', 'Connection closed by peer', 'Broken pipe',
              'Timed out waiting', 'Connection refused', 'Socket Timeout')


@MODEL_WRAPPERS.register_module()
class CPUDistributedDataParallel(MMDistributedDataParallel):
    """``MMDistributedDataParallel`` for CPU processes (gloo): no device ids, no SyncBN.

    mmengine's ``Runner.wrap_model`` always adds ``device_ids=[LOCAL_RANK]`` for a
    ``DistributedDataParallel`` subclass; torch only accepts device ids for GPU modules, so they are
    dropped here. ``torch.nn.SyncBatchNorm`` cannot run on CPU tensors, so SyncBN layers are
    reverted to ``BatchNorm`` before wrapping (mmengine only does this for non-distributed runs).

    Use it through the config: ``model_wrapper_cfg = dict(type='CPUDistributedDataParallel')``
    (done by :func:`prepare_cpu_distributed_cfg`). Registered in mmengine's root
    ``MODEL_WRAPPERS``, so mmdet's and mmseg's scopes find it too.

    Args:
        module (nn.Module): The model to wrap (on the CPU).
        device_ids, output_device: Accepted for compatibility with the Runner and ignored.
        **kwargs: Passed to ``MMDistributedDataParallel`` (``broadcast_buffers``,
            ``find_unused_parameters``, ``detect_anomalous_params``...).
    """

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        module = revert_sync_batchnorm(module)
        super().__init__(module=module, device_ids=None, output_device=None, **kwargs)


def _timeout(timeout) -> Optional[datetime.timedelta]:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=timeout)


def init_cpu_dist(launcher: str, backend: str = 'gloo', port: Optional[int] = None,
                  timeout=None) -> None:
    """Initialise torch.distributed for CPU processes, without touching CUDA.

    Reads the rank / world size the launcher provides, the way mmengine's ``init_dist`` does, but
    never calls ``torch.cuda.set_device``:

    - ``pytorch`` (torchrun / ``tools/dist_*.sh``): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
      ``MASTER_PORT`` are already set.
    - ``slurm`` (``tools/slurm_*.sh``): derived from ``SLURM_PROCID``, ``SLURM_NTASKS``,
      ``SLURM_LOCALID`` and the first host of ``SLURM_NODELIST`` (``scontrol show hostname``);
      the port is ``port``, else ``MASTER_PORT``, else 29500.
    - ``mpi``: derived from ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}``; ``MASTER_ADDR`` must be set,
      ``MASTER_PORT`` defaults to 29500.

    Does nothing if a default process group already exists.

    Args:
        launcher (str): ``'pytorch'``, ``'slurm'`` or ``'mpi'``.
        backend (str): torch.distributed backend; ``'gloo'`` is the one that works on CPU.
        port (int, optional): Master port for slurm.
        timeout (int | float | timedelta, optional): Collective timeout (seconds if a number).
    """
    if torch_dist.is_initialized():
        return
    env = os.environ
    if launcher == 'pytorch':
        for key in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'):
            if key not in env:
                raise RuntimeError(
                    f'--launcher pytorch needs the environment variable {key}; start the script '
                    'with torchrun (tools/dist_train.sh / tools/dist_test.sh do).')
    elif launcher == 'slurm':
        node_list = env['SLURM_NODELIST']
        env['MASTER_ADDR'] = subprocess.getoutput(
            f'scontrol show hostname {node_list} | head -n1')
        if port is not None:
            env['MASTER_PORT'] = str(port)
        env.setdefault('MASTER_PORT', '29500')
        env['WORLD_SIZE'] = env['SLURM_NTASKS']
        env['RANK'] = env['SLURM_PROCID']
        env['LOCAL_RANK'] = env.get('SLURM_LOCALID', '0')
    elif launcher == 'mpi':
        if 'MASTER_ADDR' not in env:
            raise KeyError('--launcher mpi needs the environment variable MASTER_ADDR')
        env.setdefault('MASTER_PORT', '29500')
        env['WORLD_SIZE'] = env['OMPI_COMM_WORLD_SIZE']
        env['RANK'] = env['OMPI_COMM_WORLD_RANK']
        env['LOCAL_RANK'] = env['OMPI_COMM_WORLD_LOCAL_RANK']
    else:
        raise ValueError(f'Invalid launcher {launcher!r}; expected pytorch, slurm or mpi')
    kwargs = {}
    if timeout is not None:
        kwargs['timeout'] = _timeout(timeout)
    torch_dist.init_process_group(
        backend=backend,
        init_method='env://',
        rank=int(env['RANK']),
        world_size=int(env['WORLD_SIZE']),
        **kwargs)


def prepare_cpu_distributed_cfg(cfg) -> None:
    """Switch a config, in place, to gloo + :class:`CPUDistributedDataParallel`.

    - ``env_cfg.dist_cfg.backend`` becomes ``'gloo'`` (the bases say ``'nccl'``).
    - ``model_wrapper_cfg`` becomes ``dict(type='CPUDistributedDataParallel', ...)``, keeping any
      other keys the config set; without one, the Runner's defaults (``broadcast_buffers=False``,
      ``find_unused_parameters=cfg.find_unused_parameters``) are used.

    Raises:
        ValueError: If the config asks for a model wrapper other than (MM)DistributedDataParallel
            (e.g. FSDP / DeepSpeed), which this CPU path cannot provide.
    """
    env_cfg = cfg.setdefault('env_cfg', {})
    dist_cfg = env_cfg.setdefault('dist_cfg', {})
    dist_cfg['backend'] = 'gloo'
    wrapper = cfg.get('model_wrapper_cfg')
    if wrapper is None:
        cfg['model_wrapper_cfg'] = dict(
            type=CPU_DDP_TYPE,
            broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False))
        return
    wrapper_type = wrapper.get('type', 'MMDistributedDataParallel')
    if wrapper_type not in ('MMDistributedDataParallel', 'DistributedDataParallel', CPU_DDP_TYPE):
        raise ValueError(
            f'model_wrapper_cfg.type={wrapper_type!r} cannot run on CPU; CPU distributed runs '
            f'use {CPU_DDP_TYPE} (a DistributedDataParallel without device ids).')
    wrapper['type'] = CPU_DDP_TYPE


def init_distributed(cfg, launcher: str) -> bool:
    """Initialise distribution early, before the Runner is built (the tools call this).

    Early initialisation lets the tools run rank-aware preparation (e.g. rank 0 generating the
    shapes dataset while the others wait at a barrier); the Runner then finds an initialised
    process group and skips ``init_dist``.

    - ``launcher == 'none'``: nothing to do; returns False.
    - CUDA available: ``mmengine.dist.init_dist(launcher, **cfg.env_cfg.dist_cfg)``, exactly what
      the Runner would do.
    - no CUDA: :func:`prepare_cpu_distributed_cfg` then :func:`init_cpu_dist` (gloo).

    Args:
        cfg (mmengine.Config): The full config; modified in place on CPU.
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.

    Returns:
        bool: True if a distributed run was set up.
    """
    if launcher == 'none':
        return False
    dist_cfg = dict(cfg.get('env_cfg', {}).get('dist_cfg', {}))
    if torch.cuda.is_available():
        from mmengine.dist import init_dist
        if not torch_dist.is_initialized():
            init_dist(launcher, **dist_cfg)
        return True
    prepare_cpu_distributed_cfg(cfg)
    cfg.env_cfg.dist_cfg.setdefault('timeout', DEFAULT_GLOO_TIMEOUT_S)
    dist_cfg = dict(cfg.env_cfg.dist_cfg)
    dist_cfg.pop('backend', None)
    init_cpu_dist(launcher, backend='gloo', port=dist_cfg.pop('port', None),
                  timeout=dist_cfg.pop('timeout', None))
    return True


def lost_peer_message(error: BaseException, cfg=None, where: str = '',
                      job: str = 'training') -> Optional[str]:
    """A clear message if ``error`` says that another rank of the run is gone or stuck, else None.

    gloo reports a rank that died (killed, out of memory, crashed) as a broken connection as soon
    as the others next talk to it, and one that hangs (or is stopped) as a collective that timed
    out after ``env_cfg.dist_cfg.timeout`` seconds.

    Args:
        error (BaseException): What the run raised.
        cfg (mmengine.Config, optional): The run's config, for the timeout.
        where (str): Where the run was, e.g. ``'iteration 12/80000'``.
        job (str): ``'training'`` or ``'testing'``, for the message.
    """
    if not isinstance(error, RuntimeError) or not torch_dist.is_initialized():
        return None
    text = ' '.join(str(error).split())
    if not any(marker in text for marker in _LOST_PEER):
        return None
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    timeout = None
    if cfg is not None:
        timeout = (cfg.get('env_cfg') or {}).get('dist_cfg', {}).get('timeout')
    stuck = 'Timed out' in text or 'Timeout' in text
    what = (f'another rank did not answer within the collective timeout ({timeout} s, '
            f'env_cfg.dist_cfg.timeout): it hangs, is stopped, or is much slower' if stuck else
            'another rank has stopped (killed, out of memory or crashed)')
    first = re.sub(r'^\[[^\]]*\]\s*', '', text.split('. This is typically')[0])[:300]
    return (f'Distributed {job} stopped on rank {rank} of {world_size}'
            f'{" at " + where if where else ""}: {what}. gloo: {first}. See the other ranks\' '
            f'output (the launcher\'s log) for the cause, then resume from the last checkpoint '
            f'with --resume. The timeout is set with --cfg-options '
            f'env_cfg.dist_cfg.timeout=SECONDS.')


@contextlib.contextmanager
def distributed_session(cfg, launcher: str):
    """Run a tool's body inside an initialised process group, destroyed on the way out.

    ``with distributed_session(cfg, args.launcher): ...`` calls :func:`init_distributed` and, when
    the block ends (normally or by an exception), collects garbage and then calls
    ``torch.distributed.destroy_process_group()`` if a group exists, as torch asks every trainer
    process to do. Two ways a gloo rank can fail *after* its work is done are avoided:

    - Left to the interpreter's exit, gloo's worker threads may still hold tensors when Python is
      torn down, and the process aborts (``terminate called without an active exception``).
    - Destroying the group joins those threads. torch's Python handle of the group releases the
      GIL while doing so, but DDP's C++ ``Reducer`` holds the group too and is freed with the GIL
      held: if it drops the last reference, the join waits for a worker that waits for the GIL,
      forever (seen in this project's tests). So the DDP model must be gone before the group is
      destroyed: the tools build and run their Runner in a function called inside the block;
      here, the locals of the frames of an exception that ends the block are cleared (its
      traceback would keep a crashed Runner alive) and garbage collection frees what reference
      cycles kept.

    Args:
        cfg (mmengine.Config): The full config; modified in place on CPU.
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.

    Yields:
        bool: True if a distributed run was set up.
    """
    try:
        yield init_distributed(cfg, launcher)
    finally:
        if torch_dist.is_available() and torch_dist.is_initialized():
            _release_frames_of(sys.exc_info()[1])
            gc.collect()
            torch_dist.destroy_process_group()


def _release_frames_of(error: Optional[BaseException]) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback (and in those of
    the exceptions it chains), so that a Runner that raised is not kept alive by them.

    The traceback still prints (file, line and code stay); only the locals are dropped.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
