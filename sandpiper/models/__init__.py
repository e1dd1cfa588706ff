"""Model tooling: the tiny policy model tests and the demo run on, and the import of
pretrained models into policy folders (``sandpiper model init-tiny`` / ``sandpiper model
import``).

- :mod:`~sandpiper.models.tiny`: build the tiny model (weights, tokenizer, chat template);
- :mod:`~sandpiper.models.importer`: a GGUF file or a Hugging Face folder to an untied
  policy folder;
- ``data/``: the files shipped with them (the tokenizer's training corpus and its generator,
  the tiny model's chat template).

Heavy libraries (torch, transformers, tokenizers) are imported inside the functions.
"""
