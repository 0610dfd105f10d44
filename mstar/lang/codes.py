"""Parse diagnostic codes MW001-MW099: the code -> one-line title registry of the parser.

Codes of later passes (MW100-MW499) live in mstar/compiler/codes.py. docs/language.md shows an
example of every code listed here.
"""
from __future__ import annotations

UNEXPECTED_CHARACTER = "MW001"
UNEXPECTED_TOKEN = "MW002"
UNEXPECTED_END = "MW003"
MISSING_LBRACE = "MW004"
ROWS_NEEDS_LE = "MW005"
MISSING_ARROW = "MW006"
UNKNOWN_ENGINE = "MW007"
CAP_WITHOUT_NUMBER = "MW008"
MISSING_RBRACE = "MW009"
RESERVED_WORD = "MW010"
MODEL_LINE = "MW011"
UNKNOWN_CAPTURE_FAMILY = "MW012"
UNKNOWN_ATTENTION_ROUTE = "MW013"
UNKNOWN_CHUNK_POLICY = "MW014"
UNKNOWN_EDGE_FLAG = "MW015"
UNKNOWN_STATE_KIND = "MW016"
CLIENT_WITHOUT_MODALITY = "MW017"
UNKNOWN_ROLE_WORD = "MW018"
DUPLICATE_SETTING = "MW020"
CAPTURE_WITHOUT_BATCH = "MW021"
NUMBER_OUT_OF_RANGE = "MW022"
INVALID_STRING = "MW023"
NESTING_TOO_DEEP = "MW024"
INTERNAL_PARSER_ERROR = "MW099"

TITLES: dict[str, str] = {
    UNEXPECTED_CHARACTER: "unexpected character",
    UNEXPECTED_TOKEN: "unexpected token",
    UNEXPECTED_END: "unexpected end of file",
    MISSING_LBRACE: "missing `{` after a block header",
    ROWS_NEEDS_LE: "`rows W = n` written instead of `rows W <= n`",
    MISSING_ARROW: "missing `->` before an edge",
    UNKNOWN_ENGINE: "unknown engine kind",
    CAP_WITHOUT_NUMBER: "`cap` without a number",
    MISSING_RBRACE: "missing `}`: a block is not closed",
    RESERVED_WORD: "a reserved word used as a name",
    MODEL_LINE: "a spec starts with exactly one `model NAME` line",
    UNKNOWN_CAPTURE_FAMILY: "unknown capture family",
    UNKNOWN_ATTENTION_ROUTE: "unknown attention route",
    UNKNOWN_CHUNK_POLICY: "unknown stream chunk policy",
    UNKNOWN_EDGE_FLAG: "unknown edge flag",
    UNKNOWN_STATE_KIND: "unknown state kind",
    CLIENT_WITHOUT_MODALITY: "a client edge without a modality",
    UNKNOWN_ROLE_WORD: "unknown role, modality, model kind or batching rule",
    DUPLICATE_SETTING: "a setting given twice",
    CAPTURE_WITHOUT_BATCH: "a capture without `batch=[...]`",
    NUMBER_OUT_OF_RANGE: "a number out of range",
    INVALID_STRING: "a quoted string with an invalid escape",
    NESTING_TOO_DEEP: "blocks nested too deeply",
    INTERNAL_PARSER_ERROR: "internal parser error (a bug: please report it)",
}
