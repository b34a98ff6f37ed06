"""Building the model through Hugging Face, and what is injected into it: LoRA, MoE experts, attention over packed
rows, chunked MLP and adapter branches, weight loading and seeded init."""
