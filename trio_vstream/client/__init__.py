"""Client of the ``/v1/realtime/video`` endpoint: ``python -m trio_vstream client``.

Two layers. `stream_video` is the importable part that tools and tests use: it speaks
only the wire protocol (through `trio_vstream.protocol.ClientProtocol`), so it works
against any server of the protocol, the vllm-omni reference included, and it always
hands back what arrived as a `StreamResult`, whatever way the session ended, because a
partial video is still worth keeping. `run_client` is the command line around it:
signals, a progress line, the output files and the summary.

The received stream is fragmented MP4 (made for Media Source Extensions). Desktop
players and editors cope badly with it (no duration, slow seeking), so `remux_to_mp4`
copies its packets, without re-encoding, into a plain progressive MP4.

The private modules behind the names below hold one concern each; what each holds is in
the layout map, ``docs/architecture.md`` (kept there only, so that a new module is one
edit).
"""

from trio_vstream.client._cli import (
    EXIT_CONNECTION,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_SERVER_ERROR,
    EXIT_USAGE,
    run_client,
)
from trio_vstream.client._flags import API_KEY_ENV, DEFAULT_URL, add_client_arguments
from trio_vstream.client._replay import (
    EXIT_MISMATCH,
    ReplayError,
    ReplayPlan,
    ReplayReport,
    add_replay_arguments,
    load_recording,
    replay,
    run_replay,
)
from trio_vstream.client._results import (
    InteractionRecord,
    ReceivedChunk,
    ScheduledInteraction,
    StreamConnectError,
    StreamOutcome,
    StreamResult,
)
from trio_vstream.client._stream import (
    MAX_MESSAGE_SIZE,
    ChunkCallback,
    MessageCallback,
    stream_video,
    watch_video,
)
from trio_vstream.client._viewer import PlaybackViewer, ViewerFigures, check_startup
from trio_vstream.client._watch import add_watch_arguments, run_watch, watch_link_url
from trio_vstream.media.remux import RemuxError, remux_to_mp4

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_URL",
    "EXIT_CONNECTION",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_SERVER_ERROR",
    "EXIT_USAGE",
    "MAX_MESSAGE_SIZE",
    "ChunkCallback",
    "InteractionRecord",
    "MessageCallback",
    "PlaybackViewer",
    "ReceivedChunk",
    "RemuxError",
    "ReplayError",
    "ReplayPlan",
    "ReplayReport",
    "ScheduledInteraction",
    "StreamConnectError",
    "StreamOutcome",
    "StreamResult",
    "ViewerFigures",
    "add_client_arguments",
    "add_replay_arguments",
    "add_watch_arguments",
    "check_startup",
    "load_recording",
    "remux_to_mp4",
    "replay",
    "run_client",
    "run_replay",
    "run_watch",
    "stream_video",
    "watch_link_url",
    "watch_video",
]
