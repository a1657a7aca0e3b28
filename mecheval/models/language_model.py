"""LanguageModel: embedding, blocks, final LayerNorm, tied output head, and named sites.

    logits = model(tokens)                                  (B, L) -> (B, L, vocab_size)
    logits = model.forward_from(layer, residual)            run blocks layer.. on a residual
    model(tokens) == model.forward_from(0, model.embed(tokens))

Sites are named "layers.{i}.{site}" (see `site_names()`); `intervene(...)` reads and patches
them for one forward pass (see its docstring). Outside `intervene` a site is a module call that
returns its input: no hooks, no copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers import Site, SitePlan, StateSite
from mecheval.layers.resume import Resume
from mecheval.models.blocks import build_block
from mecheval.models.config import ModelConfig

# zoology's init scales the initial weights of these residual-stream outputs (GPT-2 style), by
# parameter name: attention's and Hyena's (and Mamba's) out_proj and the MLP's fc2. Outputs
# named otherwise (Based's proj_o, H3's output_linear, DeltaNet's o_proj) keep N(0, 0.02), as
# in the study.
_RESIDUAL_OUTPUTS = ("out_proj.weight", "fc2.weight")
INITIALIZER_RANGE = 0.02


class InterventionRecord(dict):
    """The reads of one intervention: site name -> tensor."""

    def __missing__(self, name: str) -> torch.Tensor:
        raise KeyError(
            f"no activation recorded for site {name!r}: it was not read, or the forward pass "
            "did not reach it (forward_from skips earlier layers)"
        )


class LanguageModel(nn.Module):
    """A model of the study: token embedding (tied to the output head), optional learned
    position embeddings, `config.n_layers` blocks, final LayerNorm (with bias).

    Args:
        config: the validated `ModelConfig`.
    """

    def __init__(self, config: ModelConfig) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        super().__init__()
        self.config = config
        d = config.d_model
        self.embedding = nn.Embedding(config.vocab_size, d)
        if config.uses_position_embeddings:
            self.position_embedding = nn.Embedding(config.max_len, d)
        else:
            self.position_embedding = None
        self.layers = nn.ModuleList(build_block(config, i) for i in range(config.n_layers))
        self.norm_f = nn.LayerNorm(d)
        if config.init == "study":
            self._init_weights()
        self._index_sites()

    def _index_sites(self) -> None:
        """Index the sites of the blocks built (a subclass that builds its own parts calls it
        last)."""
        self._sites = self._collect_sites()
        self._intervening = False
        self._context_sizes: dict[int, list[int]] = {}

    # -- forward ---------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, L) integer, L <= max_len -> residual stream (B, L, d_model)."""
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(
                f"tokens must be a (B, L) integer tensor, got {tokens.dtype} of shape "
                f"{tuple(tokens.shape)}"
            )
        length = tokens.shape[1]
        if not 1 <= length <= self.config.max_len:
            raise ValueError(
                f"sequence length {length} must be in 1..max_len={self.config.max_len}"
            )
        x = self.embedding(tokens)
        if self.position_embedding is not None:
            x = x + self.position_embedding.weight[:length]
        return x

    def forward_from(
        self,
        layer_index: int,
        residual: torch.Tensor,
        at: torch.Tensor | None = None,
        resumes: list[Resume] | None = None,
        head: bool | str = True,
        stop: int | None = None,
    ) -> torch.Tensor | None:
        """Run blocks layer_index..n_layers-1, the final norm and the tied head.

        Args:
            layer_index: first block to run, 0..n_layers (n_layers: norm and head only).
            residual: (B, L, d_model), the residual stream entering that block.
            at: optional (B,) integer, one position per row: the head then runs only
                there (the loss and the interventions read one position; at vocab 8195 the
                head dominates a small model's step); or (B, P), P positions per row.
            resumes: optional, one `Resume` per block run: each block's mixer continues from
                its context and leaves the context after these positions in it (see
                `resume_from`, the form that returns them).
            head: False runs the blocks alone (for their sites' reads, or the contexts they
                leave) and returns None: no final norm, no head. "hidden" stops before the
                head: the final norm's output, whose product with `unembedding` transposed
                is the logits.
            stop: run blocks layer_index..stop - 1 alone and return the residual stream
                leaving the last of them (B, L, d_model): no final norm, no head (`head`
                and `at` are then ignored).

        Returns:
            logits (B, L, vocab_size), or (B, vocab_size) at `at` ((B, P, vocab_size)
            at (B, P) positions); (B, L, d_model) or (B, d_model) for head "hidden"; None
            without head.
        """
        self._check_run(layer_index, residual, at, head)
        if stop is not None:
            if not layer_index < stop <= len(self.layers):
                raise ValueError(
                    f"stop must be in {layer_index + 1}..{len(self.layers)}, got {stop}"
                )
            for i, block in enumerate(self.layers[layer_index:stop]):
                residual = block(residual, None if resumes is None else resumes[i])
            return residual
        blocks = self.layers[layer_index:]
        if resumes is not None and len(resumes) != len(blocks):
            raise ValueError(f"resumes must hold one context per block run ({len(blocks)})")
        # Only the rows' positions reach the head: when nobody looks at the sites after the
        # last mixer, the last block's MLP runs at those positions alone.
        last_at = None  # where the last block runs its MLP: at one position per row, or all
        last = blocks[-1] if blocks else None
        if at is not None and at.dim() == 1 and last is not None:
            last_at = at if last.after_mixer_idle() else None
        if not head and last is not None and last.after_mixer_idle():
            last_at = torch.zeros(residual.shape[0], dtype=torch.long, device=residual.device)
        for i, block in enumerate(blocks):
            resume = None if resumes is None else resumes[i]
            residual = block(residual, resume, last_at if i == len(blocks) - 1 else None)
        if not head:
            return None
        if last_at is not None:
            hidden = self.norm_f(residual[:, 0])
        else:
            hidden = self.norm_f(residual)
            if at is not None:
                rows = torch.arange(hidden.shape[0], device=hidden.device)
                rows = rows if at.dim() == 1 else rows[:, None]
                hidden = hidden[rows, at.to(hidden.device)]
        return hidden if head == "hidden" else F.linear(hidden, self.unembedding)

    def _check_run(self, layer_index: int, residual, at, head) -> None:
        """forward_from's arguments, checked (a ValueError names the first one that is off)."""
        if head not in (True, False, "hidden"):
            raise ValueError(f"head must be True, False or 'hidden', got {head!r}")
        if not 0 <= layer_index <= len(self.layers):
            raise ValueError(f"layer_index must be in 0..{len(self.layers)}, got {layer_index}")
        if residual.dim() != 3 or residual.shape[-1] != self.config.d_model:
            raise ValueError(
                f"residual must have shape (B, L, {self.config.d_model}), "
                f"got {tuple(residual.shape)}"
            )
        if residual.shape[1] > self.config.max_len:
            raise ValueError(
                f"sequence length {residual.shape[1]} exceeds max_len={self.config.max_len}"
            )
        if at is not None and (
            not isinstance(at, torch.Tensor)
            or at.dim() not in (1, 2)
            or at.shape[0] != residual.shape[0]
            or at.dtype.is_floating_point
        ):
            raise ValueError(
                f"at must have shape ({residual.shape[0]},), one integer position per "
                f"row, or ({residual.shape[0]}, P), got {at!r:.80}"
            )

    @property
    def unembedding(self) -> torch.Tensor:
        """The head's (vocab_size, d_model) matrix, tied to the embedding: logits are the
        final norm's output times its transpose, with no bias."""
        return self.embedding.weight

    def resume_from(
        self,
        layer_index: int,
        residual: torch.Tensor,
        contexts: list[tuple | None] | None = None,
        at: torch.Tensor | None = None,
        head: bool | str = True,
        leave: bool = True,
    ) -> tuple[torch.Tensor | None, list[tuple]]:
        """Run positions that follow others (the contract between models and the intervention
        engine; mecheval.layers.mixer).

        Args:
            layer_index, residual, at, head: as in `forward_from`; residual holds the
                positions after those the contexts cover.
            contexts: per block run, the context its mixer left after the earlier positions
                (None, or a None entry: the sequence starts here).
            leave: False when the contexts after these positions are not wanted (a patched
                run's): mixers may then skip forming them, and the list returned may hold
                None in their place.

        Returns:
            (logits, the contexts after these positions, one per block run). Every mixer of
            the zoo resumes (it declares `resumable`); a model with one that does not is rerun
            from position 0 instead (`can_resume`).
        """
        if not self.can_resume(layer_index):
            raise ValueError("a mixer from this layer on cannot resume a sequence")
        blocks = self.layers[layer_index:]
        given = contexts if contexts is not None else [None] * len(blocks)
        resumes = [Resume(c, leave) for c in given]
        logits = self.forward_from(layer_index, residual, at, resumes, head)
        return logits, [r.context for r in resumes]

    def context_sites(self) -> list[str] | None:
        """The sites whose values in one run give every block's mixer context after any
        position (their `context_sites`, see mecheval.layers.mixer); None when a mixer does
        not declare them (its contexts then come from a run in segments)."""
        names = []
        for i, block in enumerate(self.layers):
            shorts = block.mixer.context_sites
            if shorts is None:
                return None
            names += [f"layers.{i}.{short}" for short in shorts]
        return names

    def contexts_from(self, record: dict, points: list[int]) -> dict[int, list[tuple]]:
        """point -> every block's mixer context after positions [0, point), from one run's
        reads of `context_sites()` (states at the positions just before `points`)."""
        contexts = {}
        for index, point in enumerate(points):
            contexts[point] = []
            for i, block in enumerate(self.layers):
                shorts = block.mixer.context_sites
                values = {short: record[f"layers.{i}.{short}"] for short in shorts}
                contexts[point].append(block.mixer.context_from(values, point, index))
        return contexts

    def can_resume(self, layer_index: int = 0) -> bool:
        """Whether every mixer from this layer on resumes a sequence (`resume_from` may run
        from it); a caller reruns from position 0 where not."""
        return all(block.mixer.resumable for block in self.layers[layer_index:])

    def forward(self, tokens: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, L) integer -> logits (B, L, vocab_size), or (B, vocab_size) at one
        position per row if `at` (B,) is given (see forward_from)."""
        return self.forward_from(0, self.embed(tokens), at)

    # -- sizes -----------------------------------------------------------------------------

    def num_params(self) -> int:
        """Trainable parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def state_size(self, sequence_length: int | None = None) -> int:
        """Floats of state one sequence carries from token to token when generating, summed
        over layers, after `sequence_length` tokens (default max_len): each mixer's
        `state_size`, or, where a mixer declares none, the floats of the context it leaves.

        Per mixer of the zoo: attention keeps its key/value cache (2 d L); Mamba its SSM state
        (d_inner d_state) and conv window (d_inner (d_conv - 1)); DeltaNet its state (H K V)
        and three conv windows; Based its KV and normaliser state over the symmetric Taylor
        features; H3 its shift-SSM taps and diagonal-SSM modes; long convolutions (Hyena,
        BaseConv's long conv) every past input (d L) plus short-conv windows; a short conv its
        last W - 1 inputs. MLPs and norms carry nothing. zoology counts fewer terms for some
        mixers (only the SSM state for Mamba, only d N for H3); each mixer's `state_size` says
        which.
        """
        return sum(self.layer_state_sizes(sequence_length))

    def layer_state_sizes(self, sequence_length: int | None = None) -> list[int]:
        """`state_size`'s terms, one per layer."""
        length = self.config.max_len if sequence_length is None else sequence_length
        sizes = []
        for i, block in enumerate(self.layers):
            size = block.mixer.state_size(length)
            sizes.append(self._context_floats(length)[i] if size is None else size)
        return sizes

    def context_size(self, sequence_length: int) -> int:
        """Floats of the contexts a sequence run in segments carries after `sequence_length`
        tokens, summed over layers: counted from the contexts a one-row run of that length
        leaves (mecheval.layers.mixer; 0 for a mixer that does not resume)."""
        return sum(self._context_floats(sequence_length))

    def _context_floats(self, length: int) -> list[int]:
        """Per block, the floats of the context its mixer leaves after `length` positions of
        one row (measured once per length; 0 where a mixer does not resume)."""
        if length not in self._context_sizes:
            sizes = [0] * len(self.layers)
            if length > 0:
                parameter = next(self.parameters())
                x = parameter.new_zeros(1, length, self.config.d_model)
                resumes = [Resume() if b.mixer.resumable else None for b in self.layers]
                with torch.no_grad():
                    for block, resume in zip(self.layers, resumes, strict=True):
                        x = block(x, resume)
                sizes = [0 if r is None else _floats(r.context) for r in resumes]
            self._context_sizes[length] = sizes
        return list(self._context_sizes[length])

    # -- sites -----------------------------------------------------------------------------

    def _collect_sites(self) -> dict[str, Site | StateSite]:
        sites: dict[str, Site | StateSite] = {}
        for i, block in enumerate(self.layers):
            for module in block.modules():
                if isinstance(module, (Site, StateSite)):
                    name = f"layers.{i}.{module.name}"
                    if name in sites:
                        raise RuntimeError(f"two sites named {name}")  # a bug in a layer
                    sites[name] = module
        return sites

    def site_names(self) -> list[str]:
        """Every site, in the order the forward pass reaches them, e.g. "layers.0.conv_input"."""
        return list(self._sites)

    def site(self, name: str) -> Site | StateSite:
        """The module of a site (forward hooks on a `Site` see its (B, L, C) activation)."""
        self._check_names([name])
        return self._sites[name]

    def _check_names(self, names) -> None:
        unknown = [n for n in names if n not in self._sites]
        if unknown:
            raise ValueError(
                f"unknown site(s) {', '.join(map(repr, unknown))} for this "
                f"{self.config.arch} model; see site_names()"
            )

    @contextmanager
    def intervene(
        self,
        reads: Mapping[str, torch.Tensor | None] | None = None,
        patches: Mapping[str, tuple[torch.Tensor | None, torch.Tensor]] | None = None,
    ) -> Iterator[InterventionRecord]:
        """Read and patch named sites during the forward passes run inside the block.

        Args:
            reads: site name -> positions (B,) integer (one position per batch row; rows may
                differ), (B, P) (P positions per row) or None (the whole activation).
            patches: site name -> (positions (B,), values). Values are (B, C) for a (B, L, C)
                site, (B, *state_shape) for a `state` site; positions None with values
                (B, L, C) replaces a whole (B, L, C) activation.

        Yields:
            a dict, filled during the forward pass: site name -> the read activation, (B, C)
            at the row's position, (B, P, C) at its P positions or (B, L, C) for positions
            None; for `state` sites the
            state after the row's position, (B, d_inner, d_state) for Mamba or
            (B, H, K, V) for DeltaNet, float32 ((B, L, ...) for None).

        Semantics: a patch replaces the activation at (row, position) and the forward pass
        continues from it. A read records the activation after any patch at the same site.
        Patching `state` at position p replaces the state after p: outputs from p + 1 on see
        the patched state (inside the one scan: see mecheval.layers.sites.StateSite). Reads keep
        their autograd graph (run under torch.no_grad() to avoid that). A later forward pass
        inside the same block overwrites the record. Blocks do not nest.
        """
        reads = dict(reads or {})
        patches = dict(patches or {})
        self._check_names([*reads, *patches])
        if self._intervening:
            raise RuntimeError("model.intervene(...) blocks do not nest")
        record = InterventionRecord()
        plans: dict[str, SitePlan] = {}
        for name, positions in reads.items():
            _check_positions(name, "read", positions, allow_none=True)
            plan = plans.setdefault(name, SitePlan(name=name, record=record))
            plan.read, plan.read_positions = True, positions
        for name, patch in patches.items():
            if not (isinstance(patch, tuple) and len(patch) == 2):
                raise ValueError(f"patch of site {name!r} must be a (positions, values) tuple")
            positions, values = patch
            _check_positions(name, "patch", positions, allow_none=True)
            if not isinstance(values, torch.Tensor):
                raise ValueError(f"patch values of site {name!r} must be a tensor")
            plan = plans.setdefault(name, SitePlan(name=name, record=record))
            plan.patch_positions, plan.patch_values = positions, values
        self._intervening = True
        try:
            for name, plan in plans.items():
                self._sites[name].plan = plan
            yield record
        finally:
            for name in plans:
                self._sites[name].plan = None
            self._intervening = False

    # -- initialisation ---------------------------------------------------------------------

    def _init_weights(self) -> None:
        """GPT-2 / zoology scheme for Transformer blocks; mamba-ssm's LM scheme for Mamba blocks.

        Default: every Linear weight ~ N(0, 0.02) (zoology's init, filter MLPs included),
        Linear biases 0, embeddings ~ N(0, 0.02), out_proj and fc2 weights ~ N(0, 0.02 /
        sqrt(2 n_layers)); convolutions, norms and SSM parameters keep their layers' own inits.
        Mamba blocks (the study's MambaBlock init): Linear biases 0 except mamba-ssm's
        `_no_reinit` dt bias, Linear weights at PyTorch's default, out_proj ~ kaiming-uniform /
        sqrt(n_layers); A_log, D and dt keep mamba-ssm's layer init (Mamba-2's dt_bias is no
        Linear bias: it keeps its init too). A hybrid's blocks each take their own scheme.
        """
        n_layers = self.config.n_layers
        mamba_blocks = [i for i, block in enumerate(self.layers) if block.kind == "mamba"]
        in_mamba = {id(m) for i in mamba_blocks for m in self.layers[i].modules()}
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=INITIALIZER_RANGE)
            elif isinstance(module, nn.Linear):
                if id(module) not in in_mamba:
                    nn.init.normal_(module.weight, std=INITIALIZER_RANGE)
                if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
                    nn.init.zeros_(module.bias)
        prefixes = tuple(f"layers.{i}." for i in mamba_blocks)
        for name, p in self.named_parameters():
            if name.endswith(_RESIDUAL_OUTPUTS):
                with torch.no_grad():
                    if name.startswith(prefixes):
                        nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                        p /= math.sqrt(n_layers)
                    else:
                        nn.init.normal_(p, std=INITIALIZER_RANGE / math.sqrt(2 * n_layers))


def _floats(context: tuple | None) -> int:
    """The floats a context holds."""
    return sum(t.numel() for t in context or () if t is not None)


def _check_positions(name: str, what: str, positions: object, allow_none: bool) -> None:
    if positions is None and allow_none:
        return
    dims = (1, 2) if what == "read" else (1,)
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dim() not in dims
        or positions.dtype.is_floating_point
        or positions.dtype.is_complex
        or positions.dtype == torch.bool
    ):
        shapes = "a (B,) or (B, P)" if what == "read" else "a (B,)"
        raise ValueError(
            f"{what} positions of site {name!r} must be {shapes} integer tensor or None, "
            f"got {positions!r:.80}"
        )
