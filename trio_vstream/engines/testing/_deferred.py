"""The deferred rule: `DeferredFrames` decoded as the server decodes them, later and
elsewhere, give the frames decoded at once; released instead, they leave the engine serving.
"""

from __future__ import annotations

import numpy as np

from trio_vstream.engines.contract import Chunk, DeferredFrames, release_frames
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.testing._kit import Hung, Kit, Run, Skip, in_thread, max_difference
from trio_vstream.engines.testing._probe import Probe


def check_deferred(kit: Kit, full: Run) -> None:
    """`DeferredFrames` decoded as the server decodes them: not at once (as in the full
    run), but in another thread once the stream has made its next chunks and been
    closed, in chunk order; they must give the full run's frames. Then a stream whose
    chunk is released, never decoded (a stop while it waits to be sent), must close,
    and the engine serve the next stream."""
    if not any(isinstance(chunk.frames, DeferredFrames) for chunk in full.chunks):
        return
    request = kit.request
    stream = kit.open(request)
    chunks: list[Chunk] = []
    try:
        while len(chunks) <= request.num_frames:
            chunk = in_thread("next_chunk", kit.timeout, stream.next_chunk, Probe())
            if chunk is None:
                break
            chunks.append(chunk)
    except Hung as exc:
        kit.fail("deferred", f"{exc} (a stream whose chunks were not decoded yet)")
        raise Skip from exc
    except BaseException as exc:  # the engine's own error, reported under this rule
        kit.fail("deferred", f"next_chunk raised {exc!r} before its chunks were decoded")
        return
    finally:
        kit.close(stream, "with its chunks not decoded yet")

    def decode_all() -> list[np.ndarray]:
        return [
            frames_to_uint8_array(chunk.frames, width=request.width, height=request.height)
            for chunk in chunks
        ]

    try:
        later = in_thread("DeferredFrames.decode()", kit.timeout, decode_all)
    except Hung as exc:
        kit.fail("deferred", str(exc))
        raise Skip from exc
    except Exception as exc:
        kit.fail("deferred", f"decoding after the stream's close raised {exc!r}")
        return
    finally:
        for chunk in chunks:
            release_frames(chunk.frames)
    if len(later) != len(full.frames):
        kit.fail("deferred", f"{len(later)} chunks, where the full run made {len(full.frames)}")
        return
    for index, (a, b) in enumerate(zip(later, full.frames, strict=True)):
        if max_difference(a, b) > kit.batch_atol:
            kit.fail(
                "deferred",
                f"chunk {index} decoded after the stream's next chunk and close differs "
                "from the same chunk decoded at once: what a decode needs (the latents, a "
                "decoder cache) must be the frames' own, not the stream's",
            )
            return
    stream = kit.open(request, "a stream whose chunks were decoded after its close")
    try:
        chunk = in_thread("next_chunk", kit.timeout, stream.next_chunk, Probe())
        if chunk is not None:
            release_frames(chunk.frames)
            release_frames(chunk.frames)  # the server may release twice
    except Hung as exc:
        kit.fail("deferred", f"{exc} (a chunk released, not decoded)")
        raise Skip from exc
    except BaseException as exc:
        kit.fail("deferred", f"releasing a chunk's frames raised {exc!r}")
    finally:
        kit.close(stream, "after a chunk was released, not decoded")
