"""Model families over ``cfx.nn`` layers: GPT-2, Llama, OPT, BERT, ViT, the Evoformer with its DAP, and Hugging Face interop (see ``cfx.models``)."""
