"""LoRA adapters as params pytrees (``cfx.lora``): config, init, attach, merge, peft interop."""
