"""DeepSeek-V4 (transformers' deepseek_v4): compressed sparse and heavily compressed attention beside
a sliding window, hyper-connections, hash-routed first layers. In construction: the spec mapping,
the checkpoint's tensors and its released layout's names (`loader`), and the decoder's CPU path
over a sequence's state (`model`, `attention`) are here, the layers in `models/layers/`; the
engine's side (its caches and prefix checkpoints, the compiler's reading of its tensors) and with
it the registry entry come next."""
