"""Hugging Face interop: `model.init_from`'s transformers weights (`pretrained`), the run's tokenizer (`tokenizer`),
the transformers and PEFT folders `export --format` writes (`export`)."""
