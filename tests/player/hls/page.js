// The hls.js test page's one function, playHls(url, config): play an HLS URL with hls.js
// (low-latency mode on, whatever else `config` says) and record what a viewer got, in
// window.hlsRun, for the test or the bench to read:
//
// * frames: every frame the video element presented, from requestVideoFrameCallback:
//   [mediaTime (s), presentedFrames (the element's running count, so a frame presented
//   between two callbacks is still counted), the time it was shown (ms, wall clock:
//   performance.timeOrigin + expectedDisplayTime)];
// * initPts: hls.js's INIT_PTS_FOUND events, [initPTS, timescale, the fragment's start on
//   the element's timeline]: a frame's place in the stream is its mediaTime + initPTS /
//   timescale (hls.js maps the stream's decode times onto the element's timeline by that
//   offset), the initPTS of the latest fragment at or before it (hls.js may find a new one
//   mid-play, which holds from its fragment on);
// * codecs: every codec hls.js made a source buffer for (BUFFER_CODECS; one buffer
//   "audiovideo" for our muxed fragments): an "mp4a..." only when the stream has sound;
// * live: whether the first playlist hls.js loaded was live (no EXT-X-ENDLIST yet), and
//   playlist: what that playlist said (PART-TARGET, PART-HOLD-BACK, TARGETDURATION, blocking
//   reload);
// * latency: every 250 ms while it plays, [wall clock (ms), hls.js's own estimate of its
//   distance behind the live edge (s), the distance it aims at (s)];
// * errors (every hls.js error, "type/details", "fatal" marked), fatal (the first fatal
//   one), ended (the element's "ended" event), and at the end the element's playback
//   quality and Chromium's count of audio bytes decoded.
"use strict";

window.hlsRun = null;

window.playHls = (url, config = {}) => {
  const video = document.getElementById("video");
  const run = {
    url,
    version: Hls.version,
    frames: [],
    initPts: [],
    codecs: [],
    live: null,
    playlist: null,
    latency: [],
    errors: [],
    fatal: null,
    ended: false,
    quality: null,
    audioBytes: 0,
  };
  window.hlsRun = run;
  if (!Hls.isSupported()) {
    run.fatal = "hls.js: this browser has no Media Source Extensions";
    return run.version;
  }
  const hls = new Hls({ lowLatencyMode: true, ...config });
  window.hls = hls;
  hls.on(Hls.Events.ERROR, (_event, data) => {
    const text = `${data.type}/${data.details}${data.fatal ? " fatal" : ""}`;
    run.errors.push(text);
    if (data.fatal && run.fatal == null) run.fatal = text;
  });
  hls.on(Hls.Events.LEVEL_LOADED, (_event, data) => {
    if (run.live != null) return;
    const details = data.details;
    run.live = details.live;
    run.playlist = {
      partTarget: details.partTarget,
      partHoldBack: details.partHoldBack,
      targetDuration: details.targetduration,
      canBlockReload: details.canBlockReload,
    };
  });
  hls.on(Hls.Events.BUFFER_CODECS, (_event, data) => {
    for (const track of Object.values(data)) {
      if (typeof track?.codec === "string") run.codecs.push(...track.codec.split(","));
    }
  });
  hls.on(Hls.Events.INIT_PTS_FOUND, (_event, data) => {
    run.initPts.push([data.initPTS, data.timescale, data.frag?.start ?? null]);
  });
  hls.on(Hls.Events.MANIFEST_PARSED, () => {
    video.play().catch((error) => {
      if (run.fatal == null) run.fatal = `play(): ${error}`;
    });
  });
  const onFrame = (now, meta) => {
    video.requestVideoFrameCallback(onFrame);
    run.frames.push([
      meta.mediaTime,
      meta.presentedFrames,
      performance.timeOrigin + (meta.expectedDisplayTime ?? now),
    ]);
  };
  video.requestVideoFrameCallback(onFrame);
  const sampler = setInterval(() => {
    if (video.paused || !Number.isFinite(hls.latency)) return;
    run.latency.push([performance.timeOrigin + performance.now(), hls.latency, hls.targetLatency]);
  }, 250);
  video.addEventListener("ended", () => {
    clearInterval(sampler);
    // The last frame's callback comes in a rendering step after "ended" may fire; two
    // animation frames later, every frame callback due has run (they run before them).
    requestAnimationFrame(() => requestAnimationFrame(() => {
      const quality = video.getVideoPlaybackQuality();
      run.quality = {
        total: quality.totalVideoFrames,
        dropped: quality.droppedVideoFrames,
      };
      run.audioBytes = video.webkitAudioDecodedByteCount ?? 0;
      run.ended = true;
    }));
  });
  hls.loadSource(url);
  hls.attachMedia(video);
  return run.version;
};
