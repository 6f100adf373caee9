"""Language models as pure functions over params pytrees, with HF weight converters.

``cfx.models.gpt2("small")`` / ``cfx.models.llama("tiny")`` / ``cfx.models.mixtral("tiny")`` (a Llama with
mixture-of-experts MLPs) / ``cfx.models.opt("125m")`` build decoders and
``cfx.models.bert("base", head="mlm"|"classify")`` an encoder (frozen dataclasses),
``cfx.models.vit("base")`` a Vision Transformer (``apply(params, images) -> logits (B, num_labels)``,
``loss(params, images, labels)``; equal to ``ViTForImageClassification``), and
``cfx.models.evoformer("af2")`` AlphaFold 2's Evoformer stack (``apply(params, m, z, msa_mask=,
pair_mask=, chunk_size=) -> (m, z)``). The language models have:
``init(key)``, ``apply(params, tokens, mask=None, key=None) -> logits``,
``loss(params, tokens, targets, mask=None, key=None)``, ``axes()``, ``map_blocks(f)``,
``hf_config()`` and ``parts()`` (the parts protocol: embedding | blocks | head + loss, which the
pipeline and ``cfx.parallel.Plan`` read; see ``ModelParts``). ``to_hf(model, params)`` and ``from_hf(hf_model_or_state_dict, model=None)``
convert weights to and from ``transformers``' ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
``MixtralForCausalLM`` / ``OPTForCausalLM`` / ``BertForMaskedLM`` / ``BertForSequenceClassification`` /
``ViTForImageClassification``;
``save_pretrained(directory, model, params)`` / ``from_pretrained(directory, mesh=, specs=)``
write and read Hugging Face model directories (config.json + safetensors, one file or sharded);
``pad_vocab(model, params, multiple=N)`` pads a vocabulary to split over a model axis (the padded ids
masked: the same loss and tokens), ``unpad_vocab`` strips it (HF export does so itself).
"""
from cfx._src.models.bert import BERT_PRESETS, Bert, BertConfig, bert
from cfx._src.nn.loss import cross_entropy
from cfx._src.models.evoformer import EVOFORMER_PRESETS, Evoformer, EvoformerBlock, EvoformerConfig, evoformer
from cfx._src.models.gpt2 import GPT2, GPT2_PRESETS, GPT2Config, gpt2
from cfx._src.models.hf import from_hf, hf_config, model_from_hf_config, to_hf
from cfx._src.models.hf_dir import from_pretrained, save_pretrained
from cfx._src.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, llama
from cfx._src.models.mixtral import MIXTRAL_PRESETS, Mixtral, MixtralConfig, mixtral
from cfx._src.models.opt import OPT, OPT_PRESETS, OPTConfig, opt
from cfx._src.models.parts import ChainModel, Hooks as ModelHooks, Model, ModelParts
from cfx._src.models.vit import VIT_PRESETS, ViT, ViTConfig, vit
from cfx._src.models.vocab_pad import pad_vocab, unpad_vocab

__all__ = [
    "BERT_PRESETS", "Bert", "BertConfig", "EVOFORMER_PRESETS", "Evoformer", "EvoformerBlock", "EvoformerConfig", "GPT2", "GPT2Config", "GPT2_PRESETS", "LLAMA_PRESETS", "Llama", "LlamaConfig",
    "MIXTRAL_PRESETS", "Mixtral", "MixtralConfig", "mixtral",
    "ChainModel", "Model", "ModelHooks", "ModelParts", "OPT", "OPTConfig", "OPT_PRESETS", "cross_entropy",
    "bert", "evoformer", "from_hf", "from_pretrained", "gpt2", "hf_config", "llama", "model_from_hf_config", "opt",
    "save_pretrained", "to_hf", "VIT_PRESETS", "ViT", "ViTConfig", "vit", "pad_vocab", "unpad_vocab",
]
