"""Text from a trained model: ``functitan generate`` and the sampling it runs on any model's ``apply``.

model, cfg, params = functitan.checkpoint.saved_params("runs/<run>/checkpoints/200")
new_ids = generate(model, cfg, params, tokenizer.encode("def main"), SamplingConfig(max_new_tokens=32))
"""

from ._cache import KVCache
from ._sample import SamplingConfig, filter_logits, generate, sample_next, stream

__all__ = ["SamplingConfig", "filter_logits", "generate", "sample_next", "stream", "KVCache"]
