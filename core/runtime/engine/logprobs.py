"""Logprob rows from the engine (``LogprobsLists``) as vLLM's ``{token_id: Logprob}`` dicts."""

from __future__ import annotations

from runtime.engine.detokenizer import decode_token
from runtime.messages import LogprobsLists
from runtime.outputs import Logprob


class TokenTexts:
    """Decodes single token ids for ``Logprob.decoded_token``, remembering each one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = decode_token(self.tokenizer, token_id)
            self._texts[token_id] = text
        return text


def convert_logprobs(
    lists: LogprobsLists, num_rows: int | None = None, token_texts: TokenTexts | None = None
) -> list[dict[int, Logprob]]:
    """One dict per row (position), for the first ``num_rows`` rows (all when None).

    The chosen token comes first with its vocabulary rank, then the top tokens
    with ranks 1, 2, ... (a chosen token that is also in the top keeps one
    entry). ``decoded_token`` is filled when ``token_texts`` is given.
    """
    rows = len(lists.token_ids) if num_rows is None else min(num_rows, len(lists.token_ids))
    result: list[dict[int, Logprob]] = []
    for row in range(rows):
        token_ids, logprobs = lists.token_ids[row], lists.logprobs[row]
        if len(token_ids) != len(logprobs) or not token_ids:
            raise ValueError(
                f"logprobs row {row} has {len(token_ids)} token ids and {len(logprobs)} logprobs; "
                "expected the same number, at least 1 (the chosen token)"
            )
        entry = {token_ids[0]: _make(token_ids[0], logprobs[0], lists.ranks[row], token_texts)}
        for rank, (token_id, logprob) in enumerate(zip(token_ids[1:], logprobs[1:]), start=1):
            if token_id not in entry:
                entry[token_id] = _make(token_id, logprob, rank, token_texts)
        result.append(entry)
    return result


def _make(token_id: int, logprob: float, rank: int, token_texts: TokenTexts | None) -> Logprob:
    decoded = token_texts(token_id) if token_texts is not None else None
    return Logprob(logprob=float(logprob), rank=int(rank), decoded_token=decoded)
