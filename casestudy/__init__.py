"""The case study: what a reference story's figures imply, through a roofline latency model of speculative decoding
in a voice agent on GPUs. Apart from the engine: it models a served system (vLLM on A100s), not this one."""
