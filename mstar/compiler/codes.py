"""Diagnostic codes of the compiler's check passes (MW100-MW499): the registry.

One constant per code, named after what it reports, and `TITLES`, the one-line title of each
code. docs/diagnostics.md documents every code with an example. Ranges:

    MW1xx  resolve           names to declarations; check_args: node and state arguments
    MW2xx  check_graph       walk and partition shape
    MW30x  deployment        reading the deployment YAML
    MW31x+ check_deployment  placement of nodes and walks on ranks
    MW4xx  check_combine     combined walks, caps, captures, capture memory; MW412 batching rules;
                             MW414-MW416, MW426 (check_captures) several captures a walk, replays,
                             unrolled prompt rows;
                             MW417-MW419, MW425 (check_capture_keys) guidance modes and labels;
                             MW420-MW424, MW428-MW431 (check_chunking) token budgets
                             check_chunking: step token budget, chunks, prefix cache;
                             MW432-MW433 (check_zero_sizes) caps, rows limits and capture lists
                             of no rows or tokens
    MW113-MW122 check_roles  roles: what each value is, model kinds, KV sequences (after MW4xx)
    MW124-MW126 check_submodels  sub-models and depth models of a kv node (run by check_combine)
    MW130-MW133 check_cross  cross-attention KV pools (run by check_roles)
"""
from __future__ import annotations

# ---------------------------------------------------------------- resolve (MW1xx)
UNKNOWN_NODE = "MW101"
UNKNOWN_INPUT = "MW102"
UNKNOWN_WALK = "MW103"
UNKNOWN_PARAM = "MW104"
UNKNOWN_PARTITION = "MW105"
UNKNOWN_STREAM_EDGE = "MW106"
DUPLICATE_NAME = "MW107"
RESERVED_NAME = "MW108"
UNKNOWN_ARG = "MW109"
BAD_ARG_VALUE = "MW110"
MISSING_STATE_ARG = "MW111"
DIMS_INCONSISTENT = "MW112"
MISSING_MODEL_KIND = "MW113"
INPUT_WITHOUT_ROLE = "MW114"
UNKNOWN_OUTPUT = "MW115"
NO_PROMPT_INPUT = "MW116"
ROLE_MISMATCH = "MW117"
CLIENT_MODALITY_MISMATCH = "MW118"
BAD_PROMPT = "MW119"
UNKNOWN_KV_SEQUENCE = "MW120"
KV_ACCESS_MISMATCH = "MW121"
ROLE_FOR_KIND = "MW122"
DIMS_TOO_LARGE = "MW123"
SUBMODEL_CANNOT_SHARE = "MW124"
DEPTH_MODEL_BAD = "MW125"
DEPTH_FRAMES_COUNTED = "MW126"
# check_prompt_format
BAD_PROMPT_FORMAT = "MW140"
BAD_KEEP_RANGE = "MW141"
CROSS_KV_BAD = "MW130"
CROSS_KV_NEVER_FILLED = "MW131"
CROSS_KV_FILL_MISMATCH = "MW132"
CROSS_KV_READ_BEFORE_FILL = "MW133"

# ---------------------------------------------------------------- check_graph (MW2xx)
INPUT_NOT_PRODUCED = "MW201"
CYCLE_WITHOUT_LOOP = "MW202"
LOOP_OUTPUT_NOT_PRODUCED = "MW203"
ACCUMULATE_OVERLAPS_OUTPUT = "MW204"
EDGE_TO_ABSENT_NODE = "MW205"
DEVICE_EDGE_NOT_LOOP_BACK = "MW206"
WALK_ORDER_REPEATS = "MW207"
PARTITION_CYCLE = "MW208"
WALK_PARTITION_COUNT = "MW209"
STREAM_MISMATCH = "MW210"
EMPTY_SECTION = "MW211"
BAD_LOOP_BOUND = "MW212"
STOP_WITHOUT_NAME = "MW213"
LOOP_NEST_TOO_LONG = "MW214"
BAD_LOOP_COUNT = "MW215"
BAD_REPEAT = "MW216"
BAD_CHUNK_SIZE = "MW217"
STREAM_NEVER_ENDS = "MW218"

# ---------------------------------------------------------------- deployment file (MW30x)
DEPLOYMENT_UNREADABLE = "MW301"
DEPLOYMENT_SYNTAX = "MW302"
DEPLOYMENT_UNKNOWN_KEY = "MW303"
DEPLOYMENT_BAD_VALUE = "MW304"
DEPLOYMENT_MISSING_KEY = "MW305"

# ---------------------------------------------------------------- check_deployment (MW31x-MW39x)
NOT_PLACED = "MW310"
PLACED_TWICE = "MW311"
PLACED_WITHOUT_WORK = "MW312"
DEPLOYMENT_UNKNOWN_NODE = "MW313"
DEPLOYMENT_UNKNOWN_WALK = "MW314"
RANKS_NOT_MULTIPLE = "MW315"
SHARDING_NOT_ALLOWED = "MW316"
TWO_LOCKSTEP_NODES = "MW317"
STREAM_CONSUMER_SPLIT = "MW318"
MODEL_MISMATCH = "MW319"
DUPLICATE_RANK = "MW320"
KV_HANDOFF_TP_MISMATCH = "MW321"
KV_POOL_TOO_SMALL = "MW322"
KV_POOL_TOO_LARGE = "MW323"
RANKS_NOT_CONTIGUOUS = "MW324"
RECURRENT_SLOTS_TOO_FEW = "MW325"
TP_SPLIT_IMPOSSIBLE = "MW326"
SEQUENCE_PARALLEL_UNSUPPORTED = "MW327"

# ---------------------------------------------------------------- check_combine (MW4xx)
NOT_A_WALK_OF_NODE = "MW401"
WALK_IN_TWO_COMBINES = "MW402"
CAPTURE_KEY_SPLIT = "MW403"
COMBINE_TP_GROUPS = "MW404"
CAP_ABOVE_CAPTURE = "MW405"
ROWS_ABOVE_CAPTURE = "MW406"
ROWS_NOT_IN_COMBINE = "MW407"
CAPTURE_MEMORY_OVER_BUDGET = "MW408"
COMBINE_TOO_FEW_WALKS = "MW409"
COMBINE_MIXES_MASKS = "MW410"
STEP_SIZE_TOO_LARGE = "MW411"
BATCHING_RULE_CANNOT_APPLY = "MW412"
PIECEWISE_WITHOUT_ATTENTION = "MW413"
CAPTURES_MERGEABLE = "MW414"
REPLAY_WITHOUT_CAPTURE = "MW415"
REPLAY_MISMATCH = "MW416"
CAPTURE_LABEL_UNKNOWN = "MW417"
CAPTURE_GUIDED_WITHOUT_GUIDANCE = "MW418"
CAPTURE_LABELS_MISMATCH = "MW419"
CHUNK_ABOVE_BUDGET = "MW420"
BUDGET_BELOW_FIXED_ROWS = "MW421"
BUCKETS_BELOW_BUDGET = "MW422"
CHUNKING_NOT_OWNED = "MW423"
PREFIX_CACHE_RECURRENT = "MW424"
CAPTURE_KEY_TWICE = "MW425"
UNROLL_CANNOT_APPLY = "MW426"
WHOLE_PACKED_RECURRENT = "MW427"
PREFIX_CACHE_CROSS = "MW428"
PREFIX_WALK_PER_POSITION = "MW429"
OFFLOAD_CROSS = "MW430"
PREFIX_CACHE_UNUSED = "MW431"
ZERO_ROWS = "MW432"
BAD_CAPTURE_SIZES = "MW433"
STREAM_CHUNK_PAST_ROW = "MW434"
PROMPT_ROW_PAST_BATCHED = "MW435"
MIXED_CAP_THROTTLES = "MW436"

TITLES: dict[str, str] = {
    UNKNOWN_NODE: "unknown node",
    UNKNOWN_INPUT: "not an input of that node",
    UNKNOWN_WALK: "unknown walk",
    UNKNOWN_PARAM: "unknown loop parameter",
    UNKNOWN_PARTITION: "unknown partition",
    UNKNOWN_STREAM_EDGE: "stream source names no stream edge of its partition",
    DUPLICATE_NAME: "name declared twice",
    RESERVED_NAME: "reserved name used as a declaration",
    UNKNOWN_ARG: "argument the engine does not read",
    BAD_ARG_VALUE: "argument value of the wrong kind",
    MISSING_STATE_ARG: "state declaration missing an argument",
    DIMS_INCONSISTENT: "node dims that describe no model",
    MISSING_MODEL_KIND: "stateless node without a model kind",
    INPUT_WITHOUT_ROLE: "input without a role",
    UNKNOWN_OUTPUT: "edge that is not a declared output of its node",
    NO_PROMPT_INPUT: "walk where requests enter takes no prompt",
    ROLE_MISMATCH: "output role that does not fit the destination input's role",
    CLIENT_MODALITY_MISMATCH: "client modality that does not fit the output's role",
    BAD_PROMPT: "prompt on an input that cannot take it",
    UNKNOWN_KV_SEQUENCE: "guidance or kv access naming no KV sequence of the node",
    KV_ACCESS_MISMATCH: "kv access missing or not what the walk does",
    ROLE_FOR_KIND: "role the node's model kind does not take or produce",
    DIMS_TOO_LARGE: "node dims past what the runtime can allocate",
    SUBMODEL_CANNOT_SHARE: "sub-model that cannot share its node's KV cache",
    DEPTH_MODEL_BAD: "depth model that cannot extend its output",
    DEPTH_FRAMES_COUNTED: "depth model frames counted as output tokens (warning)",
    BAD_PROMPT_FORMAT: "prompt_format that cannot frame a text prompt",
    BAD_KEEP_RANGE: "stream keep range that is empty or on a stream without tokens",
    CROSS_KV_BAD: "cross-attention KV pool the node cannot hold",
    CROSS_KV_NEVER_FILLED: "cross-attention KV pool no walk fills",
    CROSS_KV_FILL_MISMATCH: "cross-attention fill and the walk's call disagree",
    CROSS_KV_READ_BEFORE_FILL: "cross-attention KV pool read before any walk fills it",
    INPUT_NOT_PRODUCED: "input produced by nothing",
    CYCLE_WITHOUT_LOOP: "cycle outside a loop",
    LOOP_OUTPUT_NOT_PRODUCED: "loop output produced by nothing inside the loop",
    ACCUMULATE_OVERLAPS_OUTPUT: "accumulated output also a loop output",
    EDGE_TO_ABSENT_NODE: "edge to a node the walk does not run",
    DEVICE_EDGE_NOT_LOOP_BACK: "on-device edge that is not a loop-back to the same node",
    WALK_ORDER_REPEATS: "stage alternatives that start with the same walk",
    PARTITION_CYCLE: "partitions stream to each other in a cycle",
    WALK_PARTITION_COUNT: "walk not in exactly one partition",
    STREAM_MISMATCH: "stream edge, stream input and stream source disagree",
    EMPTY_SECTION: "empty section or partition",
    BAD_LOOP_BOUND: "loop bound not a positive number",
    STOP_WITHOUT_NAME: "early stop on an unnamed loop",
    LOOP_NEST_TOO_LONG: "nested loops whose maximum iterations multiply past the limit",
    BAD_LOOP_COUNT: "loop count whose default is outside 1..max",
    BAD_REPEAT: "partition repeat rule that cannot run",
    BAD_CHUNK_SIZE: "stream chunk policy of no items, or a window that never moves",
    STREAM_NEVER_ENDS: "a stream that never ends into a partition that runs until its streams end",
    DEPLOYMENT_UNREADABLE: "deployment file cannot be read",
    DEPLOYMENT_SYNTAX: "deployment file is not valid YAML",
    DEPLOYMENT_UNKNOWN_KEY: "unknown deployment key",
    DEPLOYMENT_BAD_VALUE: "deployment value of the wrong type or range",
    DEPLOYMENT_MISSING_KEY: "required deployment key missing",
    NOT_PLACED: "(node, walk) placed on no rank",
    PLACED_TWICE: "(node, walk) placed by two node groups",
    PLACED_WITHOUT_WORK: "node group places a node for a walk it does not run",
    DEPLOYMENT_UNKNOWN_NODE: "deployment names an unknown node",
    DEPLOYMENT_UNKNOWN_WALK: "deployment names an unknown walk",
    RANKS_NOT_MULTIPLE: "ranks not a multiple of tp_size x sp_size",
    SHARDING_NOT_ALLOWED: "tp_size or sp_size > 1 for a node not marked tp",
    TWO_LOCKSTEP_NODES: "two lockstep (tp x sp > 1) nodes on one worker",
    STREAM_CONSUMER_SPLIT: "stream consumer node split per walk",
    MODEL_MISMATCH: "deployment model differs from the spec's model",
    DUPLICATE_RANK: "rank listed twice in one node group",
    KV_HANDOFF_TP_MISMATCH: "KV handed between walks of different TP world sizes",
    KV_POOL_TOO_SMALL: "KV pool cannot hold one max_seq_len request",
    KV_POOL_TOO_LARGE: "KV pool, offload host pool or recurrent state past what the runtime can allocate",
    RANKS_NOT_CONTIGUOUS: "ranks not numbered 0 to N-1",
    RECURRENT_SLOTS_TOO_FEW: "fewer recurrent state slots than max_concurrent_requests",
    TP_SPLIT_IMPOSSIBLE: "tp_size does not split the kv node's heads or widths",
    SEQUENCE_PARALLEL_UNSUPPORTED: "sp_size > 1: the runtime runs no sequence parallelism",
    NOT_A_WALK_OF_NODE: "combined walk, cap or capture for a walk that does not run the node",
    WALK_IN_TWO_COMBINES: "walk in two combined walks of one node",
    CAPTURE_KEY_SPLIT: "capture-key split",
    COMBINE_TP_GROUPS: "combined walk spans TP groups on one worker",
    CAP_ABOVE_CAPTURE: "cap above the largest captured batch",
    ROWS_ABOVE_CAPTURE: "rows limit above the packed capture's batch sizes",
    ROWS_NOT_IN_COMBINE: "rows limit for a walk outside the combined walk",
    CAPTURE_MEMORY_OVER_BUDGET: "capture memory estimate over budget",
    COMBINE_TOO_FEW_WALKS: "combined walk with fewer than two distinct walks",
    COMBINE_MIXES_MASKS: "combined walk mixes causal and bidirectional walks",
    STEP_SIZE_TOO_LARGE: "cap, capture or combined walk past what the runtime can hold",
    BATCHING_RULE_CANNOT_APPLY: "batching rule that cannot apply to its walk",
    PIECEWISE_WITHOUT_ATTENTION: "piecewise capture on a node without attention layers",
    CAPTURES_MERGEABLE: "two captures of one walk that are one family",
    REPLAY_WITHOUT_CAPTURE: "capture replay of a walk with no capture of its own",
    REPLAY_MISMATCH: "capture replay by a walk whose steps compute something else",
    CAPTURE_LABEL_UNKNOWN: "capture label that is not a KV sequence of the node",
    CAPTURE_GUIDED_WITHOUT_GUIDANCE: "guided capture on a node without guidance sequences",
    CAPTURE_LABELS_MISMATCH: "capture whose KV sequences are not those its steps touch",
    CHUNK_ABOVE_BUDGET: "prefill chunk size above the step token budget",
    BUDGET_BELOW_FIXED_ROWS: "step token budget below a full step of rows that cannot be cut",
    BUCKETS_BELOW_BUDGET: "packed capture with no token bucket for a full step of chunks",
    CHUNKING_NOT_OWNED: "prefill chunk size not read without scheduler_owns_chunking",
    PREFIX_CACHE_RECURRENT: "prefix cache asked for on a node with recurrent state",
    CAPTURE_KEY_TWICE: "two captures of one walk with the same key",
    UNROLL_CANNOT_APPLY: "unroll_prompts where prompt rows cannot be unrolled",
    WHOLE_PACKED_RECURRENT: "packed capture held whole on a node with recurrent state",
    PREFIX_CACHE_CROSS: "prefix cache asked for on a node with cross-attention KV",
    PREFIX_WALK_PER_POSITION: "a prompt walk that sends a value per position cannot start after a cached prefix",
    OFFLOAD_CROSS: "KV offload asked for on a node with cross-attention KV",
    PREFIX_CACHE_UNUSED: "a prefix cache no walk can use",
    ZERO_ROWS: "cap or rows limit of no rows",
    BAD_CAPTURE_SIZES: "capture batch sizes or token buckets that are empty, zero or repeated",
    STREAM_CHUNK_PAST_ROW: "a stream's chunks feed more tokens a row than a batched capture of the walk holds",
    PROMPT_ROW_PAST_BATCHED: "a walk whose rows feed a text prompt has a batched capture",
    MIXED_CAP_THROTTLES: "a combined walk without a cap throttles its larger walk's rows",
}
