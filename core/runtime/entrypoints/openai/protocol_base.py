"""Building blocks of the request models: bounded integers and lists, the base model, and
the error that names a bad field."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


# Every integer of a request fits in 64 bits (the engine's wire format and torch need it);
# a larger one is a 400 naming the field, not an OverflowError later. Lists stop at their
# first bad item (fail_fast), so a union of list forms costs O(items), not O(items x forms).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
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


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # JSON has no inf or NaN; 1e999 parses to inf


class InvalidField(ValueError):
    """A bad request field: a 400 whose ``param`` is ``param`` (a dotted path such as
    ``response_format.json_schema.schema``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
