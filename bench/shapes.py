"""The real models whose shapes the GPU benchmarks rebuild with random weights on the device (nothing to
download): the default target and the Llama-3.1-8B shape of DESIGN.md."""

from specwire.config import ModelConfig

SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
}
