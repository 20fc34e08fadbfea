"""Stand-in for vllm.utils: nothing but the hashing submodule."""
