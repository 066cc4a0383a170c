"""DeepSpeed's `deepspeed.utils` module path, for the names a DeepSpeed script imports from it
(`tierstack.utils.zero_to_fp32`)."""
