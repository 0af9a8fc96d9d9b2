"""DeepSeek-V4 (transformers' deepseek_v4): compressed sparse and heavily compressed attention beside
a sliding window, hyper-connections, hash-routed first layers. In construction: the spec mapping,
the checkpoint's tensors and its released layout's names (`loader`) are here, the layers in
`models/layers/`; the model, and with it the registry entry, come next."""
