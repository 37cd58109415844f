"""The trainer's model: `loading` resolves a model spec (alias, folder, GGUF file) and loads the
model and tokenizer, and computes per-token log-probabilities; `lora` attaches, merges and
saves the peft LoRA adapters the default job trains."""
