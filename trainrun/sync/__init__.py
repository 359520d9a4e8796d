"""How the ranks' work is synchronised: the gradients on the wire (`wire`), their reduction overlapped with the
backward pass (`reducer`), the reduce and update, replicated or partitioned (ZeRO-1, shared memory: `update`), and
the sync policy (`distributed.sync`: every step, or DiLoCo: `diloco`)."""
