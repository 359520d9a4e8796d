"""The run configuration: dataclasses, YAML loading, ``--set`` overrides, validation.

Every field is documented once, by the string literal that follows it (the
attribute docstring); ``trainrun config show`` prints those docstrings as YAML
comments. Constraints live in the field's metadata (``min``, ``max``,
``choices``, ``path``): the checks of one key at a time. The checks across keys
and of the files keys name belong to :mod:`trainrun.run.validity`, which
:func:`load_config` takes as ``checks``; it reports every problem at once, each
with its key path, as one :class:`~trainrun.errors.UsageError` (exit code 2).

One module per job, this package's face re-exporting them (``from trainrun import config as C``):
``fields`` (``opt``), ``model`` (the ``model`` section and the families), ``schema`` (every other section,
``Config``, the eval metric names), ``coerce`` (YAML values into the schema's types), ``load`` (YAML and
``--set`` in, paths), ``text`` (YAML out, the changed keys, docs/configuration.md). The package imports
nothing of trainrun but ``errors``.
"""

from .fields import opt  # noqa: F401
from .load import (Checks, absolutize, apply_overrides, from_dict, init_from_config_json,  # noqa: F401
                   load_config, parse_override, path_fields, read_yaml, resolve_path)
from .model import (FAMILIES, BertConfig, GPT2Config, LlamaConfig, LoraConfig, LossConfig, ModelConfig,  # noqa: F401
                    add_family_section, config_json_values, positions)
from .schema import (DEFAULT_MAX_STEPS, EVAL_NAME, CheckpointConfig, Config, DataConfig,  # noqa: F401
                     DebugConfig, DistributedConfig, EarlyStoppingConfig, EngineConfig, GraphsConfig, LoggingConfig,
                     LRScheduleConfig, MlflowConfig, OptimizerConfig, ParamGroupConfig, ProfileConfig,
                     RunConfig, TensorBoardConfig, TrainConfig, WandbConfig, eval_key, eval_set_of, get,
                     greater_is_better, parse_duration, watched_metric)
from .text import changed_keys, field_docs, markdown_reference, to_dict, to_text_changed, to_yaml  # noqa: F401
