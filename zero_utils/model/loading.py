"""Load a causal LM and its tokenizer from a Hub id or a local folder; the bundled tiny Llama needs no download.

A local folder that holds a config but no weights (like the bundled `assets/tiny-llama`) builds the model from
its config with random initialisation (seeded by the caller); folders with weights load them. Weights load only
from safetensors: a pickled `.bin` checkpoint from elsewhere could run code on load. Also: counting parameters,
and the model's greedy answer to a prompt once trained (`greedy_answer`, on every rank of a sharded model).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zero_utils.data.sft_examples import render_prompt
from zero_utils.model.deepspeed_setup import zero3_init_disabled
from zero_utils.model.wrapping import reshard_after_inference
from zero_utils.run import distributed
from zero_utils.run.errors import UserError
from zero_utils.run.hub import reaching

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def has_pretrained_weights(name_or_path: str) -> bool:
    """Whether `--model` names pretrained weights: a Hub id, or a local folder holding safetensors weights; False for
    a local folder with only a config (the bundled model: the recipes draw its weights from the seed)."""
    local = _check_local(name_or_path)
    return local is None or not local.is_dir() or any((local / f).exists() for f in _WEIGHT_FILES)


def _check_local(name_or_path: str) -> Path | None:
    """The local path `name_or_path` names, "~" expanded (what transformers is then given: it does not expand it), or
    None for a Hub id; `UserError` for a path that does not exist."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"--model {name_or_path!r} does not exist; pass an existing local folder or a Hub model id.")
    return None


# A folder holds a tokenizer when it has one of these (fast, sentencepiece, BPE vocabulary, or its config).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None):
    """Load the tokenizer (at the Hub `revision`, if given). One without a pad token gets its EOS token as pad
    (padding never reaches the loss). A folder without tokenizer files, or a Hub id that cannot be reached, is a
    `UserError` (zero_utils.run.hub)."""
    from transformers import AutoTokenizer

    local = _check_local(name_or_path)
    if local is not None and local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        raise UserError(f"--model {name_or_path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); save "
                        "the model's tokenizer there with tokenizer.save_pretrained(folder).")
    with reaching("--model", name_or_path, revision=revision):
        tokenizer = AutoTokenizer.from_pretrained(str(local or name_or_path), trust_remote_code=trust_remote_code,
                                                  revision=revision or None)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_on_every_node(accelerator, name_or_path: str, flag: str = "--model") -> None:
    """[several processes] Whether the local path `name_or_path` exists is the same on every rank: a folder on some
    nodes' disks only is a `UserError` on every rank naming the machine ranks (nodes, torchrun's numbering) that
    lack it and those that have it; present everywhere or nowhere (then `_check_local`'s sentence), nothing
    happens. One small all-gather; every rank must call it. Engines: all."""
    if accelerator.num_processes == 1:
        return
    has = distributed.per_rank(accelerator, {"has": int(Path(name_or_path).expanduser().exists())})["has"]
    if all(has) or not any(has):
        return
    per_node = distributed.local_world_size(accelerator)
    lacking, holding = ({rank // per_node for rank, found in enumerate(has) if found == want} for want in (0, 1))
    raise UserError(f"{flag} {name_or_path!r} exists on machine rank {', '.join(map(str, sorted(holding)))} but not "
                    f"on machine rank {', '.join(map(str, sorted(lacking)))}: a local {flag} must exist at the same "
                    "path on every node (copy it there, or use a file system every node mounts), or pass a Hub id "
                    "(downloaded once per node).")


def load_config(name_or_path: str, trust_remote_code: bool = False, revision: str | None = None, *,
                accelerator=None):
    """Load the model config (no weights, at the Hub `revision` if given); `UserError` if the path is missing, the
    Hub id cannot be reached (zero_utils.run.hub) or the model is not a causal LM. With the job's `accelerator`
    (every rank must then call it), a local path that exists on some nodes only is one sentence on every rank
    naming the machine ranks that lack it (`check_on_every_node`)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if accelerator is not None:
        check_on_every_node(accelerator, name_or_path)
    local = _check_local(name_or_path)
    if local is not None and local.is_dir() and not (local / "config.json").exists():
        raise UserError(f"--model {name_or_path!r} has no config.json; point it at a Hugging Face model folder.")
    with reaching("--model", name_or_path, revision=revision):
        config = AutoConfig.from_pretrained(str(local or name_or_path), trust_remote_code=trust_remote_code,
                                            revision=revision or None)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "auto_map", None):
        raise UserError(f"--model {name_or_path!r} is a {config.model_type!r} model, not a causal LM; "
                        "pass a decoder model (Llama, Mistral, Qwen2, ...).")
    return config


FLASH = "flash_attention_2"


def choose_attention(requested: str, device: torch.device, mixed_precision: str) -> tuple[str, str]:
    """The attention implementation (`load_causal_lm`'s `attn_implementation`) a recipe with packed rows runs, and a
    line saying why ('' when there is nothing to say). `requested` (--attn_implementation) when given. Else, on a
    CUDA device with bf16/fp16 compute and flash-attn installed (transformers' `is_flash_attn_2_available`), FLASH:
    packed rows take its varlen kernel (zero_utils.data.attention), where sdpa gets the dense block mask transformers
    builds per row and SDPA cannot use its flash kernel with a mask. Else '' (transformers' default, sdpa), with a
    line on CUDA saying that packed rows run SDPA's masked kernel and how to get the other. CPU: ('', '') whatever
    is installed. Engines: all."""
    if requested or device.type != "cuda":
        return requested, ""
    from transformers.utils import is_flash_attn_2_available

    if mixed_precision in ("bf16", "fp16") and is_flash_attn_2_available():
        return FLASH, (f"attention: {FLASH} (flash-attn is installed, compute in {mixed_precision}): packed rows take "
                       "its varlen kernel; --attn_implementation sdpa keeps transformers' default.")
    why = ("flash-attn runs in bf16/fp16 only" if is_flash_attn_2_available()
           else "pip install flash-attn and the recipe takes its varlen kernel")
    return "", ("attention: sdpa. With packed rows transformers gives it a dense block mask per row, so SDPA runs its "
                f"masked kernel, not its flash one ({why}).")


def load_causal_lm(name_or_path: str, *, accelerator=None, attn_implementation: str | None = None,
                   trust_remote_code: bool = False, quantization_config=None, revision: str | None = None,
                   reward_pad_token_id: int | None = None):
    """Build or load a `transformers` causal LM in fp32 (master weights; mixed precision casts for compute).

    Returns the model, on CPU (pretrained weights at the Hub `revision`, if given; a Hub model is first downloaded
    once per node, `download_once_per_node`). With only a config in a local
    folder the weights are randomly initialised from the current torch seed, whole on every rank, so every engine
    starts from the same weights (under DeepSpeed ZeRO-3, `zero.Init` would draw them partition by partition in
    another order: it is switched off for random init and stays on for pretrained weights). Engines: all.

    Under the engines that shard parameters, pretrained weights are read whole by rank 0 alone (DDP and ZeRO-1/2
    read them on every rank, which holds them whole anyway):
    - FSDP2 with `fsdp_cpu_ram_efficient_loading: true` in the YAML: rank 0 reads the weights while every other
      rank waits outside collectives (`distributed.run_on_main_process`: reading 140 GB is not bounded by the
      collective timeout), then returns the model with its parameters on the meta device, and
      `wrapping.shard_model` broadcasts rank 0's weights shard by shard. With `quantization_config` (QLoRA)
      every rank loads its own 4-bit copy instead.
    - DeepSpeed ZeRO-3 with `zero3_init_flag: true`: transformers builds the model partitioned under
      `deepspeed.zero.Init`, rank 0 reads the weights and each parameter is scattered as it is loaded.

    `reward_pad_token_id`: load it as a reward model instead, a sequence classifier with one output
    (`AutoModelForSequenceClassification`, num_labels 1): the causal LM's decoder as it is, a new score head (hidden
    x 1, initialised as transformers initialises a new weight) in place of the output head, and this pad id in its
    config (transformers scores each row at its last token that is not the pad id). The same loading paths.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    download_once_per_node(accelerator, name_or_path, revision)
    config = load_config(name_or_path, trust_remote_code, revision)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    auto = AutoModelForCausalLM
    if reward_pad_token_id is not None:  # [reward] a one-output classifier on the same decoder
        auto = AutoModelForSequenceClassification
        config.num_labels, config.pad_token_id = 1, reward_pad_token_id
        kwargs.update(num_labels=1, pad_token_id=reward_pad_token_id)
    local = _check_local(name_or_path)
    if local is not None and local.is_dir() and not any((local / f).exists() for f in _WEIGHT_FILES):
        if any(local.glob("*.bin")):
            raise UserError(f"--model {name_or_path!r} holds only pickled .bin weights; convert them to safetensors "
                            "(they are loaded only as safetensors, which cannot run code).")
        if quantization_config is not None:
            raise UserError(f"--qlora quantizes pretrained weights, but --model {name_or_path!r} holds only a config; "
                            "point --model at a folder with safetensors weights or at a Hub model id.")
        with zero3_init_disabled(accelerator):  # [ZeRO-3]
            return auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                    **_from_config(kwargs))
    if quantization_config is not None:
        # [QLoRA] Every rank quantizes its own copy while loading (4-bit: about a quarter of the bf16 bytes): a
        # quantized layer cannot be built empty on the meta device and filled by rank 0's broadcast afterwards.
        kwargs["quantization_config"] = quantization_config
    elif loads_on_rank0_only(accelerator):  # [FSDP2] rank 0 reads while the others wait outside any collective
        def read_weights():
            with reaching("--model", name_or_path, revision=revision):
                return auto.from_pretrained(str(local or name_or_path), dtype=torch.float32, use_safetensors=True,
                                            trust_remote_code=trust_remote_code, revision=revision or None, **kwargs)

        model = distributed.run_on_main_process(accelerator, read_weights,
                                                what=f"rank 0 reading the weights of --model {name_or_path}")
        if accelerator.is_main_process:
            return model
        from accelerate import init_empty_weights

        # Parameters on the meta device (no memory), buffers real: zero_utils.model.wrapping.shard_model materialises
        # this rank's shards and fills them from rank 0's weights.
        with init_empty_weights(), zero3_init_disabled(accelerator):
            model = auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                     **_from_config(kwargs))
        model.tie_weights()  # the tie must hold before sharding: FSDP2 keeps a shared weight in one group
        return model
    with reaching("--model", name_or_path, revision=revision):
        return auto.from_pretrained(str(local or name_or_path), dtype=torch.float32, use_safetensors=True,
                                    trust_remote_code=trust_remote_code, revision=revision or None, **kwargs)


def _from_config(kwargs: dict) -> dict:
    """`from_config` takes the attention implementation, not config values (set on the config already)."""
    return {k: v for k, v in kwargs.items() if k == "attn_implementation"}


# What a causal LM's Hub repository holds that loading it needs (config, tokenizer, chat template, safetensors
# weights, remote code); not .bin/.pt/.gguf weights or other formats.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


def download_once_per_node(accelerator, name_or_path: str, revision: str | None = None) -> None:
    """Download a Hub model's files (DOWNLOAD_PATTERNS) into each node's Hugging Face cache once, before any rank
    loads it: each node's local main process downloads while every rank of every node waits outside collectives
    (`distributed.run_on_main_process(per_node=True)`; a 140 GB download is not bounded by the collective timeout,
    and no rank starts a load, such as ZeRO-3's `zero.Init` broadcasts, while another node is still downloading).
    Every later `from_pretrained` reads the node's cache. Nothing to do for a local folder or a single process.
    Every rank must call it. Engines: all."""
    if accelerator is None or accelerator.num_processes == 1 or _check_local(name_or_path) is not None:
        return

    def download() -> None:
        from huggingface_hub import snapshot_download

        with reaching("--model", name_or_path, revision=revision):
            snapshot_download(name_or_path, revision=revision or None, allow_patterns=DOWNLOAD_PATTERNS)

    distributed.run_on_main_process(accelerator, download, per_node=True,
                                    what=f"the download of --model {name_or_path}")


def loads_on_rank0_only(accelerator) -> bool:
    """True when pretrained weights are read by rank 0 alone and broadcast at sharding time: an FSDP2 launch of
    more than one process whose YAML sets `fsdp_cpu_ram_efficient_loading: true`. Engines: FSDP2."""
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return (plugin is not None and accelerator.num_processes > 1 and bool(getattr(plugin, "cpu_ram_efficient_loading",
                                                                                  False)))


def weights_identity(name_or_path: str, revision: str | None = None) -> str | None:
    """What names `--model`'s weights without reading them, for keys of values computed from them (a preference
    loss's precomputed reference log-probs): a Hub id's resolved commit (from the local Hugging Face cache, where
    `download_once_per_node` or `load_config` put it), or a local folder's weight files with their sizes and
    modification times. None for a folder with only a config (its weights are drawn from the seed: the caller
    digests the built model instead)."""
    local = _check_local(name_or_path)
    if local is None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision or None)
        commit = Path(cached).parent.name if isinstance(cached, str) else (revision or "unresolved")
        return f"hub:{name_or_path}@{commit}"
    files = sorted(f for f in local.glob("*") if f.suffix in (".safetensors", ".bin") or f.name in _WEIGHT_FILES)
    if not files:
        return None
    return "local:" + ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of parameter elements of the whole model, also when sharded: DeepSpeed ZeRO-3 partitions report
    `ds_numel`, FSDP2 DTensors their global shape. Engines: all."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def gather_trainable_state_dict(model, accelerator) -> dict:
    """The trainable parameters (LoRA: the adapters) as whole CPU tensors {name: tensor} on the main process, {} on
    the others, gathered one tensor at a time: the frozen base is never gathered, so a few-MB adapter costs a
    few MB, not the full model. Names are those of the unwrapped model (`accelerator.unwrap_model`), as PEFT's
    `save_pretrained(state_dict=...)` expects. Every rank must call it (sharded tensors are collectives).
    Engines: all."""
    from zero_utils.run.distributed import gathered

    state = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():
        if param.requires_grad:
            full = gathered(param)
            if accelerator.is_main_process:
                state[name] = full
    return state


# ---------------------------------------------------------------------------------------------- generation
# Inference on a model that may be sharded: every rank runs the same forward passes, so FSDP2 and ZeRO-3 can gather
# each layer's parameters from all ranks.

def _prompt_ids(tokenizer, prompt: str, device) -> torch.Tensor:
    text = render_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt: str, max_new_tokens: int, device) -> str:
    """The model's greedy answer to one user `prompt`, formatted as in training. Runs exactly `max_new_tokens`
    forward passes on every rank (no early stop), so ranks of a sharded model never wait on each other; the
    answer is cut at the first EOS. Every rank must call it."""
    ids = _prompt_ids(tokenizer, prompt, device)
    prompt_len = ids.shape[1]
    model.eval()
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    reshard_after_inference(model)  # [FSDP2] free what generation left gathered
    model.train()
    new = ids[0, prompt_len:].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True).strip()


@torch.no_grad()
def last_position_logits(model, tokenizer, prompt: str, device) -> torch.Tensor:
    """fp32 logits [vocab] at the last position of `prompt` (exports are checked against them). Every rank must
    call it."""
    model.eval()
    logits = model(input_ids=_prompt_ids(tokenizer, prompt, device), use_cache=False).logits[0, -1].float().cpu()
    reshard_after_inference(model)  # [FSDP2]
    model.train()
    return logits
