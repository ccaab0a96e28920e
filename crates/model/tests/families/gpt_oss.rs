//! gpt-oss beyond matching transformers: prefill chunks, sliding-window rings with sinks,
//! every KV dtype, and bad files naming what is wrong.
