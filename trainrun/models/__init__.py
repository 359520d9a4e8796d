"""The model families (:mod:`.registry`); importing the package registers the built-in ones."""

from . import gpt2  # noqa: F401 - registers its family
from . import bert  # noqa: F401 - registers its family
from . import llama  # noqa: F401 - registers its family
