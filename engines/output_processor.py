"""Output processing: a sequence's text as tokens arrive (incremental detokenisation, stop strings found across
token boundaries and cut from the text), and the `RequestOutput`s a request's consumer receives: cumulative
text, tokens and logprobs plus the delta since the previous output, holding back text that could still turn
out to be the start of a stop string."""

from __future__ import annotations

from engines.outputs import CompletionOutput, RequestOutput
from engines.sequence import Request, Sequence


def append_text(seq: Sequence, token: int, can_stop: bool) -> str | None:
    """Detokenise `token` onto `seq.text`; returns the stop string the new text completed (the text is cut
    where it starts; it may start in earlier text), if stopping is allowed yet."""
    stops = seq.request.params.stop
    before = len(seq.text)
    seq.text += seq.detokenizer.step(token)
    if not (stops and can_stop):
        return None
    start = max(0, before - max(len(s) for s in stops) + 1)
    best, which = -1, None
    for s in stops:
        i = seq.text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best, which = i, s
    if which is not None:
        seq.text = seq.text[:best]
    return which


def flush_text(seq: Sequence) -> None:
    """The sequence ended by length: the detokeniser's held-back bytes become text."""
    if seq.detokenizer is not None and hasattr(seq.detokenizer, "finish"):
        seq.text += seq.detokenizer.finish()


class OutputProcessor:
    """Builds one engine's outputs; `tokenizer` (None for token-id-only engines) names the logprobs' tokens."""

    def __init__(self, model_name: str, tokenizer: object | None):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def build(self, req: Request, final: bool) -> RequestOutput:
        """The request's output now; advances each sequence's sent marks (what the deltas start from)."""
        outs = []
        for seq in req.seqs:
            params = req.params
            text_end = len(seq.text)
            if params.stop and not seq.finished:  # hold back what could be the start of a stop string
                text_end = max(seq.sent_text, text_end - max(len(s) for s in params.stop) + 1)
            toks = seq.output_token_ids
            lps = seq.logprobs
            new_lps = None
            if lps is not None:
                new_lps = lps[seq.sent_logprobs:]
                if self.tokenizer is not None:
                    for pos in new_lps:
                        for t, lp in pos.items():
                            lp.decoded_token = self.tokenizer.token_text(t)
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[:text_end] if not seq.finished else seq.text,
                token_ids=toks, logprobs=list(lps) if lps is not None else None,
                cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=(seq.text if seq.finished else seq.text[:text_end])[seq.sent_text:],
                delta_token_ids=toks[seq.sent_tokens:], delta_logprobs=new_lps))
            seq.sent_tokens = len(toks)
            seq.sent_text = len(seq.text) if seq.finished else text_end
            seq.sent_logprobs = len(lps) if lps is not None else 0
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished=final,
                             error=req.error, metrics=req.metrics, model=self.model_name)
