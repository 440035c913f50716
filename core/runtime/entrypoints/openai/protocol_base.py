"""Building blocks of the request models: bounded integers and lists, the base model, and
the error that names a bad field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


# Every integer of a request fits in 64 bits (the engine's wire format and torch need it);
# a larger one is a 400 naming the field, not an OverflowError later. Lists stop at their
# first bad item (fail_fast), so a union of list forms costs O(items), not O(items x forms).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = Annotated[list[Int64], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
TokenIdLists = Annotated[list[TokenIds], Field(fail_fast=True)]

# Lists that every child of an n > 1 request carries and that cost work per token or step:
# stop strings are searched in each new piece of text (on the server's event loop), logit
# bias is applied per row and step. OpenAI allows 4 stop strings; these bounds are generous.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[Int64], Field(fail_fast=True, max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)]
# vLLM's allowed_token_ids: at most a vocabulary's worth (one mask row per request and step whatever its length)
MAX_ALLOWED_TOKEN_IDS = 1 << 18
AllowedTokenIds = Annotated[list[Int64], Field(fail_fast=True, max_length=MAX_ALLOWED_TOKEN_IDS)]
MAX_BAD_WORDS = 1024  # vLLM's bad_words: each word's token sequences are matched against every row's output each step
BadWords = Annotated[list[str], Field(max_length=MAX_BAD_WORDS)]


# Free-form JSON fields (a JSON schema, tool parameters, kv_transfer_params, chat template arguments)
# nest at most this deep: the engine copies and walks them recursively (a schema 250 objects deep
# exhausted Python's recursion limit: a 500), and a schema the outlines backend accepts (16 nested
# sub-schemas) is about 35 levels. Their integers fit in 64 bits, as every request integer must
# (msgspec refused a larger one on the way to the engine: a 500).
MAX_JSON_DEPTH = 64


def check_free_json(value: Any) -> Any:
    """``value`` (parsed JSON) unchanged, or ValueError naming the depth or the integer that is out of bounds."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            if isinstance(node, int) and not isinstance(node, bool) and not INT64_MIN <= node <= INT64_MAX:
                raise ValueError(f"its integers must fit in 64 bits, got {str(node)[:40]}")
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"it nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(check_free_json)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # JSON has no inf or NaN; 1e999 parses to inf


class InvalidField(ValueError):
    """A bad request field: a 400 whose ``param`` is ``param`` (a dotted path such as
    ``response_format.json_schema.schema``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
