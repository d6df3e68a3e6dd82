"""Each served model's own tokenizer, as the gateway uses it.

Tokenization runs in the gateway processes, as vLLM's API server does it and
not in the replicas: the gateway needs the token count before anything else
(max_seq_len fit, admission by tokens, quota), hashes the prompt's prefix
blocks so the router's one thread only looks them up, and turns the token
chunks that come back into text (incremental detokenization, stop strings);
replicas then see only token ids, which is also what TensorRT-LLM takes. Gateways
scale out with ``router.count``, so tokenizing there never loads the router
or an engine step.

A model's tokenizer is read from its checkpoint directory (``tokenizer.json``,
``tokenizer_config.json``, the chat template, ``generation_config.json``: see
``engine/hf_tokenizer.py``); on a cluster that is the shared L3 store, which
rank 0 reads like every node. Engines that read no weights (echo, timing) and
exaserve-llama-v1 checkpoints use the byte tokenizer. Tokenizers are loaded
once, when the gateway starts where the checkpoint is already there, else on a
model's first request.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Optional

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.hf_tokenizer import ModelTokenizer, TokenizerError, load_tokenizer
from exaserve_hpc.engine.registry import engine_spec

log = logging.getLogger(__name__)


class ModelTokenizers:
    """model name (a canary version ``NAME@VERSION`` uses its model's) -> its tokenizer."""

    def __init__(self, site: SiteConfig, preload: bool = True):
        self._dirs: dict[str, Optional[Path]] = {
            m.model_name: site.model_dir(m) if engine_spec(m.engine).needs_weights else None for m in site.models}
        self._loaded: dict[str, ModelTokenizer] = {}
        self._lock = threading.Lock()
        if preload:
            for name, directory in self._dirs.items():
                if directory is None or directory.is_dir():
                    try:
                        self.get(name)
                    except TokenizerError as exc:  # said again, as a 503, on the model's requests
                        log.warning("model %s: %s", name, exc)

    def get(self, model: str) -> ModelTokenizer:
        """The model's tokenizer; TokenizerError when its checkpoint has none that can be read."""
        base = model.split("@", 1)[0]
        tokenizer = self._loaded.get(base)
        if tokenizer is not None:
            return tokenizer
        with self._lock:
            if base not in self._loaded:
                if base not in self._dirs:
                    raise TokenizerError(f"model {base!r} is not in the site config")
                self._loaded[base] = load_tokenizer(self._dirs[base])
                log.info("model %s: tokenizer %s", base, describe(self._loaded[base]))
            return self._loaded[base]


def describe(tokenizer: ModelTokenizer) -> str:
    return (f"{type(tokenizer).__name__}, vocabulary {tokenizer.vocab_size}, "
            f"EOS ids {sorted(tokenizer.eos_token_ids)}")
