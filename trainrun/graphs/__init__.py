"""``trainrun prepare``: the train, eval and optimizer graphs from a forward graph.

Input: a built-in model family (:mod:`trainrun.models`) or a user's forward ONNX (data inputs -> logits).
Output, in ``<output_dir>/graphs/``:

* ``train.onnx``      data + labels + parameters + gradient buffers + ``lazy_reset_grad``
                      -> ``loss``; each gradient is accumulated IN PLACE into its buffer
                      (com.microsoft InPlaceAccumulatorV2: reset when ``lazy_reset_grad``).
* ``eval.onnx``       data + labels + parameters -> ``loss`` (and ``logits`` if asked).
* ``forward.onnx``    data + parameters -> logits, dropout off (the base of ``export``).
* ``optimizer.onnx``  the update rule over flat buffers (see :mod:`trainrun.step.optim`).
* ``weights.safetensors``  initial parameters.
* ``frozen.safetensors``   the frozen weights (model.frozen's, model.lora's base), graph inputs too;
                           read by :mod:`.frozen` alone.
* ``manifest.json``   parameter names and shapes (in flat-buffer order), data inputs,
                      graph hashes, versions.

Parameters are graph inputs in every graph, so one set of flat buffers serves all
sessions. Gradients come from trainrun's own builder (standard ONNX ops, stock onnxruntime: the default
install) or, where the training extra installed it, onnxruntime-training's C++ gradient builder
(``graphs.builder``).

One module per job, in the order ``prepare`` applies them:

* :mod:`.names`          the tensor names the graphs and the run time agree on (no onnx import)
* :mod:`.onnx_edit`      small ONNX editing helpers every step shares
* :mod:`.forward`        the forward graph: built-in or a user's ONNX, its checks, BatchNorm state
* :mod:`.losses`         the loss heads and eval metrics; the cross-entropy rewrites
* :mod:`.dropout_nodes`  Dropout nodes off (Identity) or their masks as graph inputs
* :mod:`.casts`          mixed precision: the Casts of fp16/bf16 and the ``loss_scale`` input
* :mod:`.gradients`      the gradient graph by the builder ``graphs.builder`` picks; debug outputs
* :mod:`.ort_gradients`  onnxruntime-training's builder, its accumulators and the rewrites of its output
* :mod:`.manifest`       ``prepare`` itself, the manifest, ``load_manifest``, ``up_to_date``

:mod:`.autodiff`: trainrun's own gradient builder in standard ONNX ops (``graphs.builder: trainrun``; its train
graph has the gradients as outputs, no accumulators and no ``lazy_reset_grad``).

:mod:`.frozen`: the run-time reader of ``frozen.safetensors`` (the engine's frozen buffer; export and evaluate).

The run-time side of the manifest (which dataset feature feeds which input, the eval results) is
:mod:`trainrun.step.feeding`.
"""
