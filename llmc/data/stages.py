"""What the build's calibrate and evaluate stages take from the data sources: the token sets, the stage-key
configs and the provenance written beside the tokens (and so into the manifest)."""

from __future__ import annotations

from pydantic import TypeAdapter

from llmc.calibration.corpora import Document, corpus_fingerprint
from llmc.data.hygiene import check_overlap
from llmc.data.sources import BrownSource, DataSource, corpora_of, label
from llmc.data.tokens import TokenSet, make_tokens


def is_legacy_brown(calibration) -> bool:
    """Brown packed into windows: the stage key stays as it was before data sources existed (corpus hash +
    config; the token ids follow from those and the model's tokenizer, whose hash is an input)."""
    return calibration.dataset == BrownSource() and calibration.packing == "windows"


def calibration_tokens(calibration, tokenizer) -> TokenSet:
    c = calibration
    return make_tokens(c.dataset, tokenizer, "calibration", packing=c.packing, count=c.samples, seq_len=c.seq_len,
                       seed=c.seed)


def calibration_config(calibration, tokens: TokenSet) -> dict:
    """The calibrate stage's key config. Where activations live, which device quantizes, how often the stream
    makes a resume point and whether experts stream one at a time change no token, so they stay out."""
    cfg = calibration.model_dump(mode="json", exclude={"spill_activations", "device", "resume_every_s", "stream_experts"})
    if is_legacy_brown(calibration):
        docs = [Document(id=i, text=t) for i, t in zip(tokens.row_ids, tokens.texts)]
        legacy = {**cfg, "corpus_sha256": corpus_fingerprint(docs), "split": "calibration"}
        # the ids follow from this key and the tokenizer, except where the BOS rule dropped a declared BOS
        drops_bos = tokens.bos_decision is not None and tokens.bos_decision.differs_from_legacy
        return {**legacy, "bos": False} if drops_bos else legacy
    return {**cfg, "tokens_sha256": tokens.sha256, "chat_templates": tokens.chat_templates, "split": "calibration"}


def provenance(calibration, tokens: TokenSet) -> dict:
    """Written beside the tokens (samples.json) and copied into the manifest."""
    return {
        "dataset_label": label(calibration.dataset),
        "tokens_sha256": tokens.sha256,
        "chat_templates": tokens.chat_templates,
        "window_index": [p.get("window") for p in tokens.provenance] if calibration.packing == "windows" else None,
        "samples_provenance": tokens.provenance,
        "bos": tokens.bos,
        "bos_reason": tokens.bos_decision.reason if tokens.bos_decision else None,
    }


def eval_tokens(ev, tokenizer) -> dict[str | None, TokenSet]:
    """The evaluation windows of every corpus in eval.corpus, by label (one corpus: the single key None)."""
    return {name: make_tokens(source, tokenizer, "eval", packing="windows", count=ev.windows, seq_len=ev.seq_len,
                              seed=None)
            for name, source in corpora_of(ev.corpus).items()}


def eval_corpus_config(source):
    """The eval stage key's corpus entry: 'brown' as before, the source's fields otherwise. A corpus keys the same
    whether it is the recipe's only corpus or one of several, so their evaluations are shared."""
    return _SOURCE.dump_python(source, mode="json")


_SOURCE = TypeAdapter(DataSource)


def check_calibration_eval_overlap(calib: TokenSet, evaluation: dict[str | None, TokenSet], ev) -> int:
    """No evaluation corpus may hold calibration text (unless eval.allow_calibration_overlap): each is checked."""
    return sum(check_overlap(calib.texts, tokens.texts, allowed=ev.allow_calibration_overlap,
                             corpus=name)
               for name, tokens in evaluation.items())
