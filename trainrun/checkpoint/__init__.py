"""Checkpoints: atomic, checksummed, written in the background, resumable on any rank count.

Layout of ``<run>/checkpoints/<step>/``::

    model.safetensors      parameters, by name (safetensors: no pickle, readable by
                           safetensors/transformers/numpy tools), then the model's state that
                           is not a parameter (BatchNorm running mean/var), by name
    optimizer.safetensors  optimizer state, keys "<state>/<param name>" (e.g. exp_avg/...)
    state.json             step, updates, skipped steps, data-loader position, LR-schedule
                           position, world size and global batch at save time, seed, graph
                           hashes, the names of the optimizer states
    config.yaml            the resolved config of the run
    rank-<r>.json          each rank's step, data position and sha256 of its parameters
    checksums.json         sha256 of every file above
    COMMITTED              written last, after every rank finished: holds sha256(checksums.json)

Protocol. At a checkpoint step rank 0 writes the tensors into
``checkpoints/.staging-<step>/`` straight from the flat buffers (with ZeRO-1 the
optimizer state is gathered on rank 0 piece by piece as it is written, :mod:`trainrun.sync.update`) and every
other rank takes the digest of its parameters: the only time the step waits. The
written data are then in the kernel's page cache, the snapshot that training may
not change, so no copy of the state is kept in the process; a background thread
fsyncs the files, reads them back for their checksums and writes the small files
(every rank its ``rank-<r>.json``). Completion is agreed through the
small per-step allreduce that the runner does anyway; once every rank is done,
rank 0 writes ``COMMITTED`` into the staging directory, renames it to
``<step>`` (one atomic rename: a ``<step>`` directory never lacks its marker)
and only then deletes checkpoints beyond ``keep_last`` (each renamed to
``.pruning-<step>`` first, so a delete cut short leaves nothing that looks
committed). A directory without ``COMMITTED`` is incomplete and ignored; stale
staging and pruning directories are removed at start-up.

The safetensors files are written directly from the flat buffers: the flat
layout is the concatenation of the tensors, so the data section is one
sequential write (a device buffer goes through one reused host chunk).
"""

from .files import params_digest, sync_file, write_flat_safetensors, write_json
from .read import (FORMAT_VERSION, MODEL_GRAPHS, Held, Pinned, best_of_run, check_checkpoint, is_step_dir,
                   load_tensors_into, pin, read_config, read_state, reading, tensor_spans, verify)
from .write import PRUNING, STAGING, CheckpointWriter, Checkpointer, cleanup, copy_checkpoint

__all__ = ["FORMAT_VERSION", "MODEL_GRAPHS", "PRUNING", "STAGING", "CheckpointWriter", "Checkpointer", "Held", "Pinned",
           "best_of_run", "check_checkpoint", "cleanup", "copy_checkpoint", "is_step_dir", "load_tensors_into",
           "params_digest", "pin", "read_config",
           "read_state", "reading", "sync_file", "tensor_spans", "verify", "write_flat_safetensors", "write_json"]
