// trio_vstream player: sends session.start over the WebSocket and plays the fragmented
// MP4 chunks with Media Source Extensions as they arrive. No framework, no build step:
// this file is served as is from the package.

import { CameraIn } from "/static/camera_in.js";

const $ = (id) => document.getElementById(id);

// Keep this much video behind the playhead (for a short rewind); trim down to
// TRIM_KEEP_S when there is more. Bounded buffers never hit QuotaExceededError.
const BACK_BUFFER_S = 10;
const TRIM_KEEP_S = 4;
// Live mode: jump forward when the playhead lags the newest frame by more than this...
const LIVE_LAG_MAX_S = 1.5;
// ...to this far behind it (a little slack so the next chunk arrives before we stall).
const LIVE_LAG_TARGET_S = 0.3;
// Live mode's knobs (docs/player.md says what each costs). An object, not constants,
// so that the bench can try other values in a page (tests read them from here).
export const LIVE = {
  // vllm-omni's session.start streaming_buffer_seconds: the server generates at most
  // this much media ahead of the playhead the page reports. In steady state the
  // playhead trails generation by about this much, so it adds to every key's latency;
  // less leaves less room for a slow chunk and the video waits (an underrun).
  bufferSeconds: 0.5,
  // Playback starts once this much media is buffered ahead of the playhead (or the
  // stream has ended). It must stay below bufferSeconds: the server holds back what lies
  // beyond the window until the page plays, so a higher threshold would wait forever.
  startSeconds: 0.1,
  // Frames per chunk the page asks for (extra_params.chunk_frames, for engines that take
  // it, such as shapes); null leaves it to the engine. A shorter chunk is a shorter wait
  // for the next chunk to take a key, but the engine makes fewer frames a second.
  chunkFrames: null,
  // Catching up: the lag behind generation only grows (a slow chunk makes the video
  // wait, and it stays that much further behind), so when every one of the last
  // slackChunks chunks arrived more than slackSeconds before the playhead needed it,
  // the page plays at catchUpRate until one arrives with less: the lag comes down to what
  // the engine's slowest recent chunk needs, and a key shows that much sooner. 1 turns
  // it off.
  catchUpRate: 1.1,
  slackSeconds: 0.09,
  slackChunks: 15,
  // Send the engine's suggestions for live sessions (/v1/models live_defaults: cheaper
  // steps or no guidance branch, so a chunk is made sooner after the key) for fields the
  // form leaves empty, and with Camera in its live_input_chunk_frames as chunkFrames
  // (unless chunkFrames is set): a chunk waits for its whole window of camera frames, so
  // a shorter one reaches the screen sooner. false sends the engine's ordinary defaults.
  engineLiveDefaults: true,
};
// The live_defaults fields the page sends (what the server lets an engine suggest).
const LIVE_DEFAULT_FIELDS = ["num_inference_steps", "guidance_scale", "flow_shift"];
// Media arriving faster than this (media seconds per wall second) is not paced in real
// time: catching up would not shorten the lag (see Session.catchUp).
const CATCH_UP_PACED_RATE = 1.05;
// A video that has waited this long with at least STUCK_AHEAD_S buffered ahead of the
// playhead is stuck, not short of media (see Session.unstick).
const STUCK_MS = 1000;
const STUCK_AHEAD_S = 0.3;
// How often the page reports its playhead (session.playback), as vllm-omni's player does.
const PLAYBACK_REPORT_MS = 100;
// While the playhead does not move (paused by the user, say), generation waits and the
// server's stall clock runs: a ping this often keeps the session alive.
const PAUSED_PING_MS = 5000;
const DEFAULT_ENDPOINT = "/v1/realtime/video";
// An interaction's life, in order; "failed" can happen at any point.
const EVENT_STATES = ["sent", "queued", "started", "active", "completed"];

// ---------------------------------------------------------------------------------
// Camera controls (engines whose /v1/models entry lists "camera")
// ---------------------------------------------------------------------------------

// vllm-omni's example client's steps (camera_utils.wasd_to_camera_payload): 0.05 a step
// along X or Z, turns of 6 degrees (yaw) and 4 degrees (pitch). Unity's axes: +X right,
// +Y up, +Z forward; turns in vllm-omni's sense: a positive turn about +Y looks right, a
// positive one about +X looks up (its client sends +4 degrees for the I key).
const MOVE_STEP = 0.05;
const YAW_DEGREES = 6;
const PITCH_DEGREES = 4;
const NO_TURN = [0, 0, 0, 1];

function axisAngle(axis, degrees) {
  const half = (degrees * Math.PI) / 360;
  const sine = Math.sin(half);
  return [axis[0] * sine, axis[1] * sine, axis[2] * sine, Math.cos(half)];
}

// Each control is one velocity camera (transition_chunks 0). A press sends one, and the
// motion lasts until the next press, as in vllm-omni's client: nothing is sent on release,
// since a release that stopped the motion would cancel a short tap before the next chunk.
export const CAMERA_CONTROLS = {
  forward: { label: "W: forward", translation: [0, 0, MOVE_STEP], rotation: NO_TURN },
  back: { label: "S: back", translation: [0, 0, -MOVE_STEP], rotation: NO_TURN },
  left: { label: "A: left", translation: [-MOVE_STEP, 0, 0], rotation: NO_TURN },
  right: { label: "D: right", translation: [MOVE_STEP, 0, 0], rotation: NO_TURN },
  "look-up": { label: "↑: look up", translation: [0, 0, 0], rotation: axisAngle([1, 0, 0], PITCH_DEGREES) },
  "look-down": { label: "↓: look down", translation: [0, 0, 0], rotation: axisAngle([1, 0, 0], -PITCH_DEGREES) },
  "turn-left": { label: "←: turn left", translation: [0, 0, 0], rotation: axisAngle([0, 1, 0], -YAW_DEGREES) },
  "turn-right": { label: "→: turn right", translation: [0, 0, 0], rotation: axisAngle([0, 1, 0], YAW_DEGREES) },
  still: { label: "X: still", translation: [0, 0, 0], rotation: NO_TURN },
};

// By key position (KeyboardEvent.code), so WASD sits under the same fingers on any layout.
const CAMERA_KEYS = {
  KeyW: "forward", KeyS: "back", KeyA: "left", KeyD: "right",
  ArrowUp: "look-up", ArrowDown: "look-down", ArrowLeft: "turn-left", ArrowRight: "turn-right",
  KeyI: "look-up", KeyK: "look-down", KeyJ: "turn-left", KeyL: "turn-right",
  KeyX: "still",
};
// Latencies kept for the running median.
const LATENCY_WINDOW = 50;
// Chunk arrival times kept for liveStats (the bench's chunk margins): ten minutes of
// 8-frame chunks at 24 fps.
const ARRIVALS_KEPT = 1800;

// A share link is this page with ?watch=PATH: the session's watch_path on this server.
const WATCH_PARAM = "watch";
// Only a path on this server (never "//host/..." or a URL): the page connects where it says.
const WATCH_PATH_RE = /^\/(?!\/)[A-Za-z0-9._~\-\/]*$/;

export function readWatchPath(search) {
  const path = new URLSearchParams(search).get(WATCH_PARAM);
  return path != null && WATCH_PATH_RE.test(path) ? path : null;
}

export function shareUrl(watchPath) {
  const url = new URL(location.pathname, location.href);
  url.searchParams.set(WATCH_PARAM, watchPath);
  return url.href;
}

// "Share as HLS": the session's Low-Latency HLS playlist (video.start's hls_path, this
// server's extension) as an absolute URL on this server, for players that are not this
// page. The path is checked like a watch path: only a path on this origin is offered.
export function hlsUrl(hlsPath) {
  if (typeof hlsPath !== "string" || !WATCH_PATH_RE.test(hlsPath)) return null;
  return location.origin + hlsPath;
}

const watchPath = readWatchPath(location.search);

const server = {
  model: null, engine: null, endpoint: DEFAULT_ENDPOINT, defaults: null, needsKey: false,
  formFilled: false, interactionKinds: null, liveDefaults: {}, videoInput: false,
  liveInputChunkFrames: null,
};
let session = null;

// ---------------------------------------------------------------------------------
// The API key (servers started with --api-key)
// ---------------------------------------------------------------------------------

// sessionStorage, not localStorage: a reload in this tab keeps the key, closing the tab
// forgets it, and other tabs and later visits never see it.
const KEY_STORAGE = "trio_vstream.api_key";
// The protocol name the server selects, and the prefix of the entry that carries the key
// (trio_vstream.server.access): browsers cannot set an Authorization header on a WebSocket.
const SUBPROTOCOL = "trio-vstream";
const KEY_SUBPROTOCOL_PREFIX = "trio-vstream.key.";
let memoryKey = null; // where sessionStorage is unavailable (some privacy modes)

function apiKey() {
  try {
    return sessionStorage.getItem(KEY_STORAGE) ?? memoryKey;
  } catch {
    return memoryKey;
  }
}

function setApiKey(key) {
  memoryKey = key;
  try {
    if (key == null) sessionStorage.removeItem(KEY_STORAGE);
    else sessionStorage.setItem(KEY_STORAGE, key);
  } catch {
    // The key then lasts until a reload: still usable, only asked for again.
  }
}

// The key as a Sec-WebSocket-Protocol entry: base64url of its UTF-8, without padding,
// so any key fits the header's token characters.
export function keySubprotocol(key) {
  const bytes = new TextEncoder().encode(key);
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  const base64 = btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return KEY_SUBPROTOCOL_PREFIX + base64;
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Ask for the key; `refused` when the one just tried was not accepted.
function askForKey(refused) {
  server.needsKey = true;
  $("key-form").hidden = false;
  $("key-state").hidden = true;
  $("start").disabled = true;
  const input = $("api-key");
  if (refused) {
    $("key-error").textContent = "The server refused the key (HTTP 401). Check it and try again.";
    input.setAttribute("aria-invalid", "true");
    input.select();
  } else {
    $("key-error").textContent = "";
    input.removeAttribute("aria-invalid");
  }
  $("model-info").textContent = "This server needs an API key.";
  setStatus("Waiting for the API key.", "key");
  input.focus();
}

function keyAccepted() {
  $("key-form").hidden = true;
  $("key-error").textContent = "";
  $("api-key").value = "";
  $("api-key").removeAttribute("aria-invalid");
  $("key-state").hidden = !apiKey();
  if (!session || session.closed) {
    setIdleControls();
    setStatus("Idle.", "idle");
  }
}

// ---------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------

function setStatus(text, phase) {
  $("status").textContent = text;
  $("status").dataset.phase = phase;
}

function showError(code, message) {
  const item = document.createElement("li");
  const codeEl = document.createElement("code");
  codeEl.textContent = code;
  item.append(codeEl, ": ", message);
  $("errors").append(item);
}

function formatMs(ms) {
  return ms == null ? "–" : `${Math.round(ms)} ms`;
}

function median(values) {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

function wsUrl(endpoint) {
  // Same host as the page; wss:// when the page came over https://.
  const url = new URL(endpoint, location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

// JSON.stringify with integers beyond 2^53 written exactly: a seed typed as digits is
// sent as those digits (a JS number would round it and the clip could not be remade).
function stringifyExact(message, exact) {
  const marks = new Map();
  const copy = { ...message };
  for (const [key, digits] of Object.entries(exact)) {
    const mark = `\u0000exact-${key}-${Math.random()}`;
    marks.set(JSON.stringify(mark), digits);
    copy[key] = mark;
  }
  let text = JSON.stringify(copy);
  for (const [quoted, digits] of marks) text = text.replace(quoted, digits);
  return text;
}

// The seed as the server wrote it: JSON.parse rounds 63-bit seeds, so take the digits
// from the raw text (the occurrence that parses to the same number).
function exactSeed(raw, parsed) {
  if (typeof parsed !== "number" || Number.isSafeInteger(parsed)) return parsed;
  for (const match of raw.matchAll(/"seed"\s*:\s*(-?\d+)/g)) {
    if (Number(match[1]) === parsed) return match[1];
  }
  return parsed;
}

// ---------------------------------------------------------------------------------
// The codec string, from the init segment's avcC box
// ---------------------------------------------------------------------------------

function* mp4Boxes(view, start, end) {
  let pos = start;
  while (pos + 8 <= end) {
    let size = view.getUint32(pos);
    const type = String.fromCharCode(
      view.getUint8(pos + 4), view.getUint8(pos + 5), view.getUint8(pos + 6), view.getUint8(pos + 7),
    );
    let header = 8;
    if (size === 1) {
      size = Number(view.getBigUint64(pos + 8));
      header = 16;
    } else if (size === 0) {
      size = end - pos;
    }
    if (size < header || pos + size > end) return;
    yield { type, start: pos + header, end: pos + size };
    pos += size;
  }
}

function childBox(view, box, type) {
  for (const child of mp4Boxes(view, box.start, box.end)) if (child.type === type) return child;
  return null;
}

// "avc1.PPCCLL" (profile, constraint flags, level) for the first H.264 track, or null;
// with ",mp4a.40.2" after it when the stream also has sound (the server's AAC-LC track).
export function codecFromInit(buffer) {
  const video = videoCodecFromInit(buffer);
  return video && hasAacTrack(buffer) ? `${video},mp4a.40.2` : video;
}

function sampleEntries(buffer) {
  const view = new DataView(buffer);
  const moov = childBox(view, { start: 0, end: view.byteLength }, "moov");
  const entries = [];
  for (const trak of moov ? mp4Boxes(view, moov.start, moov.end) : []) {
    let box = trak.type === "trak" ? trak : null;
    for (const type of ["mdia", "minf", "stbl", "stsd"]) box = box && childBox(view, box, type);
    if (box) entries.push(...mp4Boxes(view, box.start + 8, box.end));
  }
  return entries;
}

function hasAacTrack(buffer) {
  return sampleEntries(buffer).some((entry) => entry.type === "mp4a");
}

function videoCodecFromInit(buffer) {
  const view = new DataView(buffer);
  const moov = childBox(view, { start: 0, end: view.byteLength }, "moov");
  if (!moov) return null;
  for (const trak of mp4Boxes(view, moov.start, moov.end)) {
    if (trak.type !== "trak") continue;
    let box = trak;
    for (const type of ["mdia", "minf", "stbl", "stsd"]) {
      box = box && childBox(view, box, type);
    }
    if (!box) continue;
    // stsd: version/flags (4) and entry count (4), then the sample entries.
    for (const entry of mp4Boxes(view, box.start + 8, box.end)) {
      if (entry.type !== "avc1" && entry.type !== "avc3") continue;
      // A visual sample entry has 78 bytes of fixed fields before its child boxes.
      const avcC = childBox(view, { start: entry.start + 78, end: entry.end }, "avcC");
      if (!avcC || avcC.end - avcC.start < 4) continue;
      const hex = (offset) => view.getUint8(avcC.start + offset).toString(16).padStart(2, "0");
      return `${entry.type}.${hex(1)}${hex(2)}${hex(3)}`.toUpperCase().replace("AVC", "avc");
    }
  }
  return null;
}

// ---------------------------------------------------------------------------------
// One session: a WebSocket, a MediaSource and what arrived
// ---------------------------------------------------------------------------------

class Session {
  // `watching`: a viewer of a watch link at that path (read-only; nothing is sent to start).
  // `camera`: a CameraIn whose frames are the session's input video (Camera in), or null.
  constructor(request, exact, fps, expectedFrames, live, watching = null, camera = null) {
    this.request = request;
    this.camera = camera;
    this.watching = watching;
    this.fps = fps;
    this.expectedFrames = expectedFrames;
    this.live = live;
    this.parts = [];          // every binary message, for Save
    this.queue = [];          // media waiting for the SourceBuffer
    this.pendingMeta = null;  // the chunk_metadata whose binary comes next
    this.mediaFrames = 0;     // frames received so far (sets each chunk's media time)
    this.chunks = 0;
    this.events = new Map();  // event id -> {item, state}
    this.nextEvent = 1;
    this.terminal = null;     // "done" or "error"
    this.closed = false;
    this.ending = false;      // no more media: endOfStream once the queue drains
    this.sourceBuffer = null;
    this.codec = null;
    this.times = { sent: null, videoStart: null, firstChunk: null, lastChunk: null };
    this.running = false;     // video.start came and no terminal message yet
    this.awaitingFrame = [];  // started events whose first frame is not on screen yet
    this.keyLatencies = [];   // ms, camera interactions: key press -> first frame showing it
    this.keyParts = [];       // ms, the same split: [press -> chunk arrived, arrived -> shown]
    // Playback-paced generation (Live): the page reports the playhead it presents.
    this.paced = request?.streaming_buffer_seconds != null;
    this.presentedTime = null;   // media time of the newest frame presented, seconds
    this.presentedFrames = 0;    // frames presented (requestVideoFrameCallback calls)
    this.reported = null;        // the last position_seconds sent
    this.reportedAt = 0;         // when a report or a ping last went (performance.now())
    this.reports = 0;            // session.playback messages sent
    this.started = false;        // playback has begun (the first "playing")
    this.underruns = 0;          // times playback waited for media after it had begun
    this.stallMs = 0;            // the time it waited, ms (a running stall included)
    this.stalledSince = null;    // when the running stall began
    this.arrivals = [];          // [media start s, performance.now()] of recent media chunks
    this.slacks = [];            // s, the last media chunks' slack (see catchUp)
    this.catchUpRate = 1;        // the playbackRate the page last set
    this.catchUps = 0;           // times it began to catch up
    this.unsticks = 0;           // seeks in place that restarted a stuck video (see unstick)
    this.unstuckAt = null;       // when the last one was made (performance.now())
    this.standingSince = null;   // since when the playing video has not moved (see unstick)

    this.video = $("video");
    this.openMediaSource();
    this.renderLatency();

    this.opened = false;
    this.received = 0;        // messages of any kind
    const key = apiKey();
    this.keyed = Boolean(key) || server.needsKey;
    // Offered only with a key: the server then selects SUBPROTOCOL.
    const protocols = key ? [SUBPROTOCOL, keySubprotocol(key)] : [];
    this.ws = new WebSocket(wsUrl(watching ?? server.endpoint), protocols);
    this.ws.binaryType = "arraybuffer";
    this.ws.addEventListener("open", () => {
      this.opened = true;
      this.times.sent = performance.now();
      if (watching) {
        setStatus("Waiting for watch.start…", "starting");
        return;
      }
      this.ws.send(stringifyExact({ type: "session.start", ...request }, exact));
      setStatus("Waiting for video.start…", "starting");
    });
    this.ws.addEventListener("message", (event) => {
      this.received += 1;
      if (typeof event.data === "string") this.onText(event.data);
      else this.onBinary(event.data);
    });
    this.ws.addEventListener("close", (event) => this.onClose(event));
    this.ticker = setInterval(() => {
      this.unstick();
      this.render();
    }, 250);
    if (this.paced) this.reporter = setInterval(() => this.reportPlayback(), PLAYBACK_REPORT_MS);
  }

  // vllm-omni's session.playback: the playhead as shown, the media time of the newest
  // frame presented (currentTime where requestVideoFrameCallback is missing). Never
  // advanced to hide a stall: a stalled playhead holds generation back, which is the
  // point. Sent when it moved; while it does not, a ping now and then keeps the
  // session's stall clock from running out.
  reportPlayback() {
    if (!this.running || this.ws.readyState !== WebSocket.OPEN) return;
    if (this.frameCallback == null && this.video.readyState >= 2) {
      this.presentedTime = Math.max(this.presentedTime ?? 0, this.video.currentTime);
    }
    const position = this.presentedTime;
    const now = performance.now();
    if (position != null && Number.isFinite(position) && position > (this.reported ?? -1)) {
      this.ws.send(JSON.stringify({ type: "session.playback", position_seconds: position }));
      this.reported = position;
      this.reportedAt = now;
      this.reports += 1;
    } else if (now - this.reportedAt >= PAUSED_PING_MS) {
      this.ws.send(JSON.stringify({ type: "session.ping" }));
      this.reportedAt = now;
    }
  }

  // How long before the playhead needed it a media chunk starting at `mediaStart` (s)
  // arrived at `now` (performance.now()); negative when it came late. While the video
  // waits for media, the chunk it waits for came late by as long as it has waited: the
  // playhead stops inside the last frame buffered (Chromium: 10 to 20 ms into it), not
  // at its end, so mediaStart - currentTime would still read most of a frame of slack
  // (measured: +0.02 to +0.04 s at 24 fps) for a chunk that made the video wait, and
  // catch-up, which stops only at a chunk without slack, would play fast for good.
  // A video below HAVE_FUTURE_DATA that is not seeking stands waiting too, whether or
  // not a "waiting" event said so (see unstick).
  slackOf(mediaStart, now) {
    if (this.stalledSince != null) return -(now - this.stalledSince) / 1000;
    const video = this.video;
    if (!video.paused && !video.seeking && video.readyState < HTMLMediaElement.HAVE_FUTURE_DATA) {
      return -(now - (this.standingSince ?? now)) / 1000;
    }
    return mediaStart - video.currentTime;
  }

  // Live catch-up (see LIVE): `slack`, how long before the playhead needs it a media
  // chunk arrived. It helps only where the server paces generation in real time (a
  // camera engine's action windows): a stream that keeps up with the faster playhead
  // is paced by the playhead itself (the buffer window), so playing faster would only
  // play it faster for good. Only the page's own rates are changed, never the user's.
  catchUp(slack) {
    if (!this.paced || !this.started) return;
    this.slacks.push(slack);
    if (this.slacks.length > LIVE.slackChunks) this.slacks.shift();
    const recent = this.arrivals.slice(-LIVE.slackChunks);
    const [first, last] = [recent[0], recent.at(-1)];
    const wall = (last[1] - first[1]) / 1000;
    const realTime = wall > 0 && (last[0] - first[0]) / wall < CATCH_UP_PACED_RATE;
    const ample = realTime && cameraOffered() && this.slacks.length >= LIVE.slackChunks &&
      Math.min(...this.slacks) > LIVE.slackSeconds;
    const rate = ample ? LIVE.catchUpRate : 1;
    const current = this.video.playbackRate;
    if (current !== rate && (current === 1 || current === this.catchUpRate)) {
      this.video.playbackRate = rate;
      this.catchUpRate = rate;
      if (rate !== 1) this.catchUps += 1;
    }
  }

  // Underruns: playback that had begun waits for media ("waiting") until it plays again.
  watchStalls() {
    this.onWaiting = () => {
      if (!this.started || this.video.seeking || this.video.ended || this.stalledSince != null) return;
      this.underruns += 1;
      this.stalledSince = performance.now();
      this.renderStalls();
    };
    this.onPlaying = () => {
      this.started = true;
      this.endStall();
    };
    this.video.addEventListener("waiting", this.onWaiting);
    this.video.addEventListener("playing", this.onPlaying);
  }

  // Chromium's audio renderer asks for more decoded audio before it plays again after
  // each underrun (a threshold that grows; measured: after two, 0.7 s buffered was not
  // enough), soon more than a Live stream's window (bufferSeconds) holds. The server
  // makes no more than the window ahead of the playhead, and the playhead waits for the
  // renderer: with sound, a loaded machine's video waited for good (readyState 2, 0.7 s
  // buffered, the media log saying audio BUFFERING_HAVE_NOTHING). A seek to where the
  // playhead stands flushes the renderers, whose thresholds start over, and playback
  // goes on. Only a video that has stood still for a second with media buffered ahead,
  // long after a renderer with enough would play. Called by the ticker.
  unstick() {
    const video = this.video;
    const now = performance.now();
    // Its own clock, from the element's state: Chromium may fire "playing" as media comes
    // and stay at HAVE_CURRENT_DATA with no "waiting" after it (seen), which ends the
    // page's stall count (stalledSince) while the video still stands.
    const standing = this.started && this.sourceBuffer && !video.paused && !video.seeking &&
      !video.ended && video.readyState < HTMLMediaElement.HAVE_FUTURE_DATA;
    if (!standing) {
      this.standingSince = null;
      return;
    }
    this.standingSince ??= now;
    if (now - Math.max(this.standingSince, this.unstuckAt ?? 0) < STUCK_MS) return;
    const ranges = this.sourceBuffer.buffered;
    const at = video.currentTime;
    let ahead = 0;
    for (let i = 0; i < ranges.length; i++) {
      if (ranges.start(i) <= at && at < ranges.end(i)) ahead = ranges.end(i) - at;
    }
    if (ahead < STUCK_AHEAD_S) return;
    this.unstuckAt = now;
    this.unsticks += 1;
    video.currentTime = at;
  }

  endStall() {
    if (this.stalledSince == null) return;
    this.stallMs += performance.now() - this.stalledSince;
    this.stalledSince = null;
    this.renderStalls();
  }

  stallTotalMs() {
    return this.stallMs + (this.stalledSince == null ? 0 : performance.now() - this.stalledSince);
  }

  renderStalls() {
    const figure = $("fig-underruns");
    if (!figure) return;
    const ms = this.stallTotalMs();
    figure.textContent = this.started ? `${this.underruns} (${formatMs(ms)})` : "–";
    figure.dataset.count = String(this.underruns);
    figure.dataset.ms = ms.toFixed(1);
  }

  // What the page measured, for tests and the bench (read-only copies).
  liveStats() {
    return {
      paced: this.paced,
      bufferSeconds: this.request?.streaming_buffer_seconds ?? null,
      presentedTime: this.presentedTime,
      presentedFrames: this.presentedFrames,
      reported: this.reported,
      reports: this.reports,
      started: this.started,
      underruns: this.underruns,
      stallMs: this.stallTotalMs(),
      keyLatencies: [...this.keyLatencies],
      playbackRate: this.video.playbackRate,
      catchUps: this.catchUps,
      slacks: [...this.slacks],
      unsticks: this.unsticks,
      keyParts: this.keyParts.map((pair) => [...pair]),
      cameraIn: this.camera?.stats() ?? null,
      arrivals: this.arrivals.map((pair) => [...pair]),
    };
  }

  openMediaSource() {
    // MediaSource where it exists; ManagedMediaSource on Safari for iOS, which has only that.
    const Source = window.MediaSource ?? window.ManagedMediaSource;
    if (!Source) {
      showError("player", "this browser has no Media Source Extensions: nothing plays here, but Save still works");
      return;
    }
    this.mediaSource = new Source();
    if (Source !== window.MediaSource) {
      // Safari only opens a ManagedMediaSource with remote playback off (or an AirPlay source).
      this.video.disableRemotePlayback = true;
    }
    this.objectUrl = URL.createObjectURL(this.mediaSource);
    this.video.src = this.objectUrl;
    this.mediaSource.addEventListener("sourceopen", () => {
      URL.revokeObjectURL(this.objectUrl);
      this.addSourceBuffer();
    }, { once: true });
    // Trims and retries happen as the playhead moves, not only when data arrives.
    this.onTimeUpdate = () => {
      this.followLiveEdge();
      this.pump();
      if (this.frameCallback == null) this.frameShown(this.video.currentTime, performance.now());
    };
    this.video.addEventListener("timeupdate", this.onTimeUpdate);
    this.watchFrames();
    this.watchStalls();
  }

  // When the first frame of a chunk that starts an interaction is shown: each presented
  // frame's media time where requestVideoFrameCallback exists, else currentTime on
  // timeupdate and on the figures' ticker (coarser, within a quarter second).
  watchFrames() {
    if (typeof this.video.requestVideoFrameCallback !== "function") {
      this.frameCallback = null;
      return;
    }
    const onFrame = (now, frame) => {
      this.frameCallback = this.video.requestVideoFrameCallback(onFrame);
      this.presentedFrames += 1;
      // A frame on screen ends a stall (Chromium may say "playing" a little later).
      if (this.started) this.endStall();
      this.presentedTime = Math.max(this.presentedTime ?? 0, frame.mediaTime);
      this.frameShown(frame.mediaTime, frame.expectedDisplayTime ?? now);
    };
    this.frameCallback = this.video.requestVideoFrameCallback(onFrame);
  }

  frameShown(mediaTime, when) {
    // Frame k starts at k / fps; a little slack for the container's time rounding.
    const slack = Math.min(1e-3, 0.25 / this.fps);
    if (this.camera) {
      this.camera.frameShown(mediaTime, when, slack);
      this.renderCameraLatency();
    }
    if (this.awaitingFrame.length === 0) return;
    const shown = this.awaitingFrame.filter((record) => mediaTime >= record.startTime - slack);
    if (shown.length === 0) return;
    this.awaitingFrame = this.awaitingFrame.filter((record) => !shown.includes(record));
    for (const record of shown) {
      const ms = Math.max(0, when - record.sentAt);
      record.latencyMs = ms;
      record.item.dataset.latencyMs = ms.toFixed(1);
      record.item.dataset.shownAt = String(mediaTime); // the media time of that frame
      const after = record.camera ? "the key" : "sending";
      record.item.querySelector(".event-shown").textContent = `, on screen ${formatMs(ms)} after ${after}`;
      if (record.camera) {
        this.keyLatencies.push(ms);
        if (this.keyLatencies.length > LATENCY_WINDOW) this.keyLatencies.shift();
        // Where the time went: the press to its chunk's arrival, and on to the screen.
        this.keyParts.push([record.startedAt - record.sentAt, when - record.startedAt]);
        if (this.keyParts.length > LATENCY_WINDOW) this.keyParts.shift();
      }
    }
    this.renderLatency();
  }

  addSourceBuffer() {
    if (this.sourceBuffer || !this.codec || this.mediaSource?.readyState !== "open") return;
    const type = `video/mp4; codecs="${this.codec}"`;
    try {
      this.sourceBuffer = this.mediaSource.addSourceBuffer(type);
      // A viewer may join mid-stream and skip chunks when it falls behind: in sequence
      // mode its chunks play back to back from 0, with no gap to stall at.
      if (this.watching) this.sourceBuffer.mode = "sequence";
    } catch (error) {
      showError("player", `cannot play ${type}: ${error.message}`);
      return;
    }
    this.sourceBuffer.addEventListener("updateend", () => {
      this.maybePlay();
      this.followLiveEdge();
      this.pump();
      this.render();
    });
    this.sourceBuffer.addEventListener("error", () => {
      showError("player", `the browser could not decode the video${this.video.error ? `: ${this.video.error.message}` : ""}`);
    });
    this.pump();
  }

  // One SourceBuffer operation at a time: a trim first if needed, else the next append.
  pump() {
    const buffer = this.sourceBuffer;
    if (!buffer || buffer.updating || this.mediaSource.readyState === "closed") return;
    // Trimming goes on after endOfStream too (remove() reopens the source; it is ended
    // again below), so a long video that arrived early does not stay in memory.
    if (this.trim(false)) return;
    if (this.queue.length === 0) {
      if (this.ending && this.mediaSource.readyState === "open") this.mediaSource.endOfStream();
      if (this.ending && this.paced) this.maybePlay();
      return;
    }
    try {
      buffer.appendBuffer(this.queue[0]);
      this.queue.shift();
    } catch (error) {
      if (error.name === "QuotaExceededError") {
        // Full even after trimming: drop all but a second behind the playhead and
        // retry on the next timeupdate, once playback has consumed some of the buffer.
        this.trim(true);
      } else {
        showError("player", `appendBuffer failed: ${error.message}`);
      }
      return;
    }
    this.maybePlay();
  }

  // Start playing once there is media: at once, or for Live (paced) once LIVE.startSeconds
  // is buffered ahead of the playhead, or the stream has ended.
  maybePlay() {
    if (this.playRequested || !this.sourceBuffer) return;
    if (this.paced && !this.ending) {
      const ranges = this.sourceBuffer.buffered;
      if (ranges.length === 0) return;
      if (ranges.end(ranges.length - 1) - this.video.currentTime < LIVE.startSeconds) return;
    }
    // Muted, so browsers let it start without another click.
    this.playRequested = true;
    this.video.play().catch(() => setStatus("Streaming: press play to watch.", "streaming"));
  }

  // Remove what lies far behind the playhead; true when a remove() was started.
  trim(urgent) {
    const ranges = this.sourceBuffer.buffered;
    if (ranges.length === 0) return false;
    const start = ranges.start(0);
    const behind = this.video.currentTime - start;
    const cut = this.video.currentTime - (urgent ? 1 : TRIM_KEEP_S);
    if ((urgent || behind > BACK_BUFFER_S) && cut > start) {
      this.sourceBuffer.remove(start, cut);
      return true;
    }
    return false;
  }

  followLiveEdge() {
    if (!this.live || !this.sourceBuffer || this.video.paused) return;
    const ranges = this.sourceBuffer.buffered;
    if (ranges.length === 0) return;
    const end = ranges.end(ranges.length - 1);
    if (end - this.video.currentTime > LIVE_LAG_MAX_S) {
      this.video.currentTime = end - LIVE_LAG_TARGET_S;
    }
  }

  onText(raw) {
    let message;
    try {
      message = JSON.parse(raw);
    } catch {
      showError("player", "the server sent text that is not JSON");
      return;
    }
    switch (message.type) {
      case "video.start": {
        this.times.videoStart = performance.now();
        this.requestId = message.request_id;
        const seed = message.config?.seed;
        this.seed = seed == null ? null : exactSeed(raw, seed);
        setStatus("Streaming.", "streaming");
        this.running = true;
        setCameraEnabled(true);
        showShare(message.watch_path, message.hls_path);
        this.camera?.start(this.ws);
        break;
      }
      case "watch.start": {
        // A viewer's first message (this server's extension): the session's config.
        this.times.videoStart = performance.now();
        this.requestId = message.request_id;
        const config = message.config ?? {};
        this.seed = config.seed == null ? null : exactSeed(raw, config.seed);
        if (Number.isInteger(config.fps) && config.fps > 0) this.fps = config.fps;
        if (Number.isInteger(config.num_frames) && config.num_frames > 0) this.expectedFrames = config.num_frames;
        if (typeof config.prompt === "string") $("model-info").textContent = `Prompt: ${config.prompt}`;
        setStatus("Watching live (read-only).", "streaming");
        this.running = true;
        break;
      }
      case "video.chunk_metadata":
        this.pendingMeta = message;
        if (message.kind === "media") this.camera?.onChunk(message, this.mediaFrames, this.fps, performance.now());
        this.onChunkEvents(message);
        break;
      case "session.interaction.queued":
        this.setEventState(message.event_id, "queued");
        break;
      case "session.done":
        this.terminal = "done";
        this.running = false;
        setCameraEnabled(false);
        setStatus(`session.done: ${message.chunks} chunks${message.stopped ? ", stopped" : ""}.`, "done");
        this.finishMedia();
        break;
      case "error":
        showError(message.code, message.message + (message.event_id ? ` (event ${message.event_id})` : ""));
        if (message.event_id) {
          this.setEventState(message.event_id, "failed");
        } else {
          this.terminal = "error";
          this.running = false;
          setCameraEnabled(false);
          setStatus(`Ended with error ${message.code}.`, "error");
        }
        break;
      default:
        break; // session.pong, and types from newer servers
    }
    this.render();
  }

  onBinary(data) {
    const meta = this.pendingMeta;
    this.pendingMeta = null;
    this.parts.push(data);
    setSaveEnabled(true);
    if (this.parts.length === 1) {
      this.codec = codecFromInit(data);
      if (!this.codec) {
        this.codec = "avc1.42E01E";
        showError("player", "no avcC box in the init segment; trying H.264 Baseline");
      }
      this.addSourceBuffer();
      showUnmute(this.codec.includes("mp4a"));
    }
    // The trailer is an mfra box: an index for files, no frames, nothing for MSE.
    if (meta?.kind === "trailer") return;
    const now = performance.now();
    this.times.firstChunk ??= now;
    this.times.lastChunk = now;
    this.chunks += 1;
    // Media times advance in onChunkEvents, as the metadata comes: this chunk's start.
    if (meta?.kind === "media") {
      const mediaStart = (this.mediaFrames - meta.num_frames) / this.fps;
      this.arrivals.push([mediaStart, now]);
      if (this.arrivals.length > ARRIVALS_KEPT) this.arrivals.shift();
      this.catchUp(this.slackOf(mediaStart, now));
    }
    this.queue.push(data);
    this.pump();
  }

  onClose(event) {
    this.closed = true;
    this.running = false;
    this.camera?.stop();
    clearInterval(this.ticker);
    clearInterval(this.reporter);
    const how = `code ${event.code}${event.reason ? `, ${event.reason}` : ""}`;
    if (!this.terminal && !this.opened && this.received === 0) {
      // A handshake answered with 401, 403 or 503 (a full server's 503 says server_busy
      // in its body): browsers hide the status and the body (code 1006).
      const why = this.keyed ? "check the API key"
        : this.watching ? "the watch link may need an API key"
        : "it may be full (try again shortly), down or draining, or refuse this page's origin";
      showError("refused", `the server refused the connection (${why})`);
      setStatus("The server refused the connection.", "closed");
      if (this.watching && !this.keyed) askForKey(false);
    } else if (!this.terminal) {
      showError("closed", `the connection closed before the session ended (${how})`);
      setStatus(`Socket closed (${how}).`, "closed");
    } else {
      setStatus(`${$("status").textContent} Socket closed.`, this.terminal === "done" ? "done" : "error");
    }
    this.finishMedia();
    setIdleControls();
    this.render();
  }

  finishMedia() {
    // Play out what arrived: endOfStream once every queued chunk is in.
    this.ending = true;
    this.pump();
  }

  stop() {
    if (this.ws.readyState !== WebSocket.OPEN) return;
    this.ws.send(JSON.stringify({ type: "session.stop" }));
    setStatus("Stopping…", "stopping");
  }

  interact(prompt, transitionChunks) {
    return this.sendInteraction({ prompt }, transitionChunks, prompt, false, performance.now());
  }

  // A camera as vllm-omni sends it: {mode, data: {translation, rotation}}. `pressedAt`:
  // when the key or button was pressed (its event's timeStamp, on performance.now()'s
  // clock), where key-to-frame latency starts.
  interactCamera(camera, label, pressedAt) {
    return this.sendInteraction({ multi_modal_data: { camera } }, 0, `camera ${label}`, true, pressedAt);
  }

  sendInteraction(event, transitionChunks, label, camera, pressedAt) {
    const eventId = `interaction-${this.nextEvent++}`;
    const interaction = { event_id: eventId, event };
    if (transitionChunks != null) interaction.transition_chunks = transitionChunks;
    this.ws.send(JSON.stringify({ type: "session.interaction", interaction }));
    const record = this.addEvent(eventId, label);
    // From the press (or the send, for a prompt) to the first frame presented that shows it.
    // A timeStamp that is not on that clock (0, or from the future) counts from now.
    const now = performance.now();
    record.sentAt = pressedAt > 0 && pressedAt <= now && now - pressedAt < 1000 ? pressedAt : now;
    record.camera = camera;
    this.setEventState(eventId, "sent");
    return eventId;
  }

  // Chunk metadata says which events this chunk starts, blends and completes.
  onChunkEvents(meta) {
    const at = this.mediaFrames / this.fps;
    for (const id of meta.started_event_ids ?? []) this.setEventState(id, "started", at);
    for (const id of meta.active_event_ids ?? []) this.setEventState(id, "active", at);
    for (const id of meta.completed_event_ids ?? []) this.setEventState(id, "completed", at);
    if (meta.kind === "media") this.mediaFrames += meta.num_frames;
  }

  addEvent(eventId, prompt) {
    const item = document.createElement("li");
    item.dataset.eventId = eventId;
    const id = document.createElement("code");
    id.textContent = eventId;
    const text = document.createElement("span");
    text.className = "event-prompt";
    text.textContent = prompt ?? "";
    const state = document.createElement("span");
    state.className = "event-state";
    const at = document.createElement("span");
    at.className = "event-at";
    const shown = document.createElement("span");
    shown.className = "event-at event-shown";
    item.append(id, " ", text, " ", state, " ", at, shown);
    $("timeline").append(item);
    const marker = document.createElement("span");
    marker.className = "marker";
    marker.title = eventId;
    $("track").append(marker);
    const record = { item, marker, state: null, sentAt: null, camera: false };
    this.events.set(eventId, record);
    return record;
  }

  setEventState(eventId, state, at) {
    if (!eventId) return;
    const record = this.events.get(eventId) ?? this.addEvent(eventId, null);
    // States only move forward (a chunk can start and complete an event at once).
    if (record.state === "failed") return;
    if (state !== "failed" && EVENT_STATES.indexOf(state) <= EVENT_STATES.indexOf(record.state)) return;
    record.state = state;
    record.item.dataset.state = state;
    record.item.querySelector(".event-state").textContent = state;
    if (state === "started" && at != null) {
      record.item.dataset.startTime = String(at);
      record.item.querySelector(".event-at").textContent = `at ${at.toFixed(2)} s`;
      const total = this.expectedFrames / this.fps;
      record.marker.style.left = `${Math.min(100, (100 * at) / total)}%`;
      record.marker.classList.add("placed");
      if (record.sentAt != null) {
        record.startTime = at;
        record.startedAt = performance.now(); // its chunk's metadata arrived
        this.awaitingFrame.push(record);
      }
    }
  }

  // Camera in: an input frame drawn -> the output frame made from it presented.
  renderCameraLatency() {
    const latencies = this.camera.latencies;
    const last = latencies.at(-1);
    $("fig-camera-latency").textContent = formatMs(last);
    const p50 = median(latencies);
    const figure = $("fig-camera-p50");
    figure.textContent = p50 == null ? "–" : `${formatMs(p50)} (of ${latencies.length})`;
    if (p50 == null) delete figure.dataset.ms;
    else figure.dataset.ms = p50.toFixed(1);
    figure.dataset.count = String(latencies.length);
  }

  renderLatency() {
    const last = this.keyLatencies.at(-1);
    const figure = $("fig-key-latency");
    figure.textContent = formatMs(last);
    if (last == null) delete figure.dataset.ms;
    else figure.dataset.ms = last.toFixed(1);
    const p50 = median(this.keyLatencies);
    const p50Figure = $("fig-key-p50");
    p50Figure.textContent = p50 == null ? "–" : `${formatMs(p50)} (of ${this.keyLatencies.length})`;
    if (p50 == null) delete p50Figure.dataset.ms;
    else p50Figure.dataset.ms = p50.toFixed(1);
    p50Figure.dataset.count = String(this.keyLatencies.length);
  }

  render() {
    const t = this.times;
    $("fig-start").textContent = t.videoStart == null ? "–" : formatMs(t.videoStart - t.sent);
    $("fig-first").textContent = t.firstChunk == null ? "–" : formatMs(t.firstChunk - t.sent);
    // As the CLI client: frames / (last media chunk - video.start).
    const span = (t.lastChunk - t.videoStart) / 1000;
    $("fig-fps").textContent = t.lastChunk != null && span > 0 ? (this.mediaFrames / span).toFixed(1) : "–";
    $("fig-chunks").textContent = String(this.chunks);
    $("fig-seed").textContent = this.seed == null ? "–" : String(this.seed);
    $("fig-codec").textContent = this.codec ?? "–";
    $("fig-request").textContent = this.requestId ?? "–";
    let ahead = null;
    let end = 0;
    const ranges = this.sourceBuffer?.buffered;
    if (ranges && ranges.length > 0) {
      end = ranges.end(ranges.length - 1);
      ahead = Math.max(0, end - this.video.currentTime);
    }
    const buffered = $("fig-buffered");
    buffered.textContent = ahead == null ? "–"
      : this.paced ? `${ahead.toFixed(2)} s (window ${this.request.streaming_buffer_seconds} s)`
      : `${ahead.toFixed(2)} s`;
    if (ahead == null) delete buffered.dataset.seconds;
    else buffered.dataset.seconds = ahead.toFixed(3);
    this.renderStalls();
    if (this.frameCallback == null && this.video.readyState >= 2) {
      this.frameShown(this.video.currentTime, performance.now());
    }
    const total = this.expectedFrames / this.fps;
    $("track-fill").style.width = `${Math.min(100, (100 * end) / total)}%`;
  }

  dispose() {
    this.camera?.stop();
    clearInterval(this.ticker);
    clearInterval(this.reporter);
    if (this.frameCallback != null) this.video.cancelVideoFrameCallback(this.frameCallback);
    this.frameCallback = undefined;
    this.video.removeEventListener("timeupdate", this.onTimeUpdate);
    this.video.removeEventListener("waiting", this.onWaiting);
    this.video.removeEventListener("playing", this.onPlaying);
    if (this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}

// ---------------------------------------------------------------------------------
// The form
// ---------------------------------------------------------------------------------

// A number field: undefined when empty, NaN when the browser could not read it.
function numberField(id) {
  const input = $(id);
  if (input.validity.badInput) return NaN;
  return input.value.trim() === "" ? undefined : Number(input.value);
}

// An engine's live_defaults as the page sends them: known fields with finite numbers.
export function liveDefaults(suggested) {
  const kept = {};
  if (suggested == null || typeof suggested !== "object") return kept;
  for (const key of LIVE_DEFAULT_FIELDS) {
    const value = suggested[key];
    if (typeof value === "number" && Number.isFinite(value)) kept[key] = value;
  }
  return kept;
}

function buildRequest() {
  const request = { prompt: $("prompt").value };
  const exact = {};
  if (server.model) request.model = server.model;
  const negative = $("negative-prompt").value;
  if (negative.trim()) request.negative_prompt = negative;
  // The server validates sizes; "640×480" and "640 x 480" are read as "640x480".
  const size = $("size").value.replace(/\s+/g, "").replace(/[×X]/g, "x");
  if (size) request.size = size;
  const fields = { fps: "fps", seed: "seed", steps: "num_inference_steps", guidance: "guidance_scale" };
  for (const [id, key] of Object.entries(fields)) {
    const value = numberField(id);
    if (Number.isNaN(value)) throw new Error(`${$(id).labels[0].textContent} is not a number`);
    if (value !== undefined) request[key] = value;
  }
  const seedText = $("seed").value.trim();
  if (/^-?\d+$/.test(seedText) && !Number.isSafeInteger(Number(seedText))) exact.seed = seedText;
  const length = numberField("length");
  if (Number.isNaN(length)) throw new Error("Length is not a number");
  if (length !== undefined) {
    // seconds is a string on the wire ("4"); num_frames a number.
    if ($("length-unit").value === "seconds") request.seconds = $("length").value.trim();
    else request.num_frames = length;
  }
  if (cameraWanted()) {
    // Frames at the session's size and rate (the server would scale others).
    const d = server.defaults ?? { width: 256, height: 256, fps: 24 };
    const [w, h] = (request.size ?? "").split("x").map(Number);
    request.input_video = {
      frame_format: "jpeg",
      fps: Math.max(1, Math.min(60, request.fps ?? d.fps)),
      width: w > 0 ? w : d.width,
      height: h > 0 ? h : d.height,
    };
  }
  if ($("live").checked) {
    // Generation paced by the playhead this page reports (session.playback), and the
    // chunks sent at the pace they play.
    request.streaming_buffer_seconds = LIVE.bufferSeconds;
    request.extra_params = { pace_to_media_time: true };
    if (LIVE.chunkFrames != null) request.extra_params.chunk_frames = LIVE.chunkFrames;
    else if (request.input_video && LIVE.engineLiveDefaults && server.liveInputChunkFrames != null) {
      request.extra_params.chunk_frames = server.liveInputChunkFrames;
    }
    if (LIVE.engineLiveDefaults) {
      for (const [key, value] of Object.entries(server.liveDefaults)) {
        if (request[key] === undefined) request[key] = value;
      }
    }
  }
  return { request, exact };
}

// Frames and fps the request will get, for media times and the timeline's scale.
function expectedShape(request) {
  const d = server.defaults ?? { fps: 24, num_frames: 48 };
  const fps = Number.isInteger(request.fps) && request.fps > 0 ? request.fps : d.fps;
  let frames = d.num_frames;
  if (Number.isInteger(request.num_frames) && request.num_frames > 0) frames = request.num_frames;
  else if (request.seconds) frames = Number(request.seconds) * fps || frames;
  return { fps, frames };
}

// The length field's default, until the user edits it: a Live session runs until
// stopped (the server's most frames, --max-num-frames), since the engine's default clip
// (2 s for shapes) ends before a person can steer; otherwise the engine's default.
function fillLength() {
  const d = server.defaults;
  if (!d || server.lengthEdited) return;
  const frames = $("live").checked && server.maxFrames ? server.maxFrames : d.num_frames;
  // Whole seconds read better; frames when the default is not a whole number of them.
  const seconds = frames / d.fps;
  $("length-unit").value = Number.isInteger(seconds) ? "seconds" : "frames";
  $("length").value = Number.isInteger(seconds) ? seconds : frames;
}

// Camera in is asked for, and the engine takes video input.
function cameraWanted() {
  return server.videoInput && $("camera-in").checked;
}

async function start() {
  let built;
  try {
    built = buildRequest();
  } catch (error) {
    showError("form", error.message);
    return;
  }
  session?.dispose();
  let camera = null;
  if (built.request.input_video) {
    const input = built.request.input_video;
    $("start").disabled = true;
    setStatus("Asking for the camera…", "connecting");
    try {
      camera = await CameraIn.open(input.width, input.height);
    } catch (error) {
      $("start").disabled = false;
      setStatus("Idle.", "idle");
      showError("camera", `no camera for Camera in: ${error.message}`);
      return;
    }
    camera.request(input.fps);
  }
  $("errors").replaceChildren();
  $("timeline").replaceChildren();
  $("track").querySelectorAll(".marker").forEach((m) => m.remove());
  setSaveEnabled(false);
  showShare(null);
  const { fps, frames } = expectedShape(built.request);
  // Reserve the video's shape before the first frame, so the page does not jump.
  const [w, h] = (built.request.size ?? "").split("x").map(Number);
  const d = server.defaults;
  const ratio = w > 0 && h > 0 ? w / h : d ? d.width / d.height : 16 / 9;
  $("video").style.aspectRatio = String(ratio);
  setStatus("Connecting…", "connecting");
  $("start").disabled = true;
  $("stop").disabled = false;
  $("send").disabled = false;
  session = new Session(built.request, built.exact, fps, frames, $("live").checked, null, camera);
  for (const element of document.querySelectorAll(".camera-in-only")) element.hidden = camera == null;
}

// Save is the owner's button in the request form, and a viewer's own (the form is
// hidden when watching): both download what arrived.
function setSaveEnabled(enabled) {
  for (const id of ["save", "watch-save"]) $(id).disabled = !enabled;
}

// The share fields: shown while a session with a watch link runs; the HLS URL beside it
// when the session has a playlist too.
function showShare(path, hlsPath) {
  const offered = typeof path === "string" && WATCH_PATH_RE.test(path);
  $("share").hidden = !offered;
  $("share-link").value = offered ? shareUrl(path) : "";
  const hls = offered ? hlsUrl(hlsPath) : null;
  $("share-hls").hidden = hls == null;
  $("share-hls-url").value = hls ?? "";
  $("share-copy").textContent = "Copy link";
  $("share-hls-copy").textContent = "Copy HLS URL";
}

// A stream with sound starts muted (browsers play sound only after a person asks for it):
// this button is that asking. Hidden for a stream without sound.
function showUnmute(sound) {
  const button = $("unmute");
  if (!button) return;
  button.hidden = !sound;
  renderUnmute();
}

function renderUnmute() {
  const muted = $("video").muted;
  $("unmute").textContent = muted ? "Sound on" : "Sound off";
  $("unmute").setAttribute("aria-pressed", String(!muted));
}

async function copyField(fieldId, buttonId) {
  const field = $(fieldId);
  field.select();
  try {
    await navigator.clipboard.writeText(field.value);
    $(buttonId).textContent = "Copied";
  } catch {
    // No clipboard permission (plain http, say): the link stays selected to copy by hand.
    $(buttonId).textContent = "Press Ctrl+C";
  }
}

// The page opened from a share link: no form, no steering; it plays the stream live.
function startWatching() {
  document.body.dataset.mode = "watch";
  for (const id of ["start-form", "interact-form", "camera-panel"]) $(id).hidden = true;
  $("watch-note").hidden = false;
  $("watch-actions").hidden = false;
  setSaveEnabled(false);
  $("model-info").textContent = "A shared stream on this server.";
  session?.dispose();
  $("errors").replaceChildren();
  setStatus("Connecting…", "connecting");
  session = new Session(null, {}, 24, 48, true, watchPath);
}

function setIdleControls() {
  $("start").disabled = false;
  $("stop").disabled = true;
  $("send").disabled = true;
  setCameraEnabled(false);
}

// ---------------------------------------------------------------------------------
// Camera keys and buttons
// ---------------------------------------------------------------------------------

function cameraOffered() {
  return server.interactionKinds?.includes("camera") ?? false;
}

function setCameraEnabled(enabled) {
  for (const button of document.querySelectorAll("[data-camera]")) button.disabled = !enabled;
}

function showCameraControls() {
  const offered = cameraOffered();
  $("camera-panel").hidden = !offered;
  for (const figure of document.querySelectorAll(".camera-only")) figure.hidden = !offered;
  // A prompt-only list hides nothing: an engine that takes no prompts hides the prompt form.
  $("interact-form").hidden = server.interactionKinds != null && !server.interactionKinds.includes("prompt");
}

// Sends a camera interaction in the running session; its event id, or null when no
// session is streaming. Exported for tests, which also send what the controls cannot
// (a "target" pose, say).
export function sendCamera(camera, label, pressedAt = performance.now()) {
  if (!session?.running || session.ws.readyState !== WebSocket.OPEN) return null;
  return session.interactCamera(camera, label, pressedAt);
}

// What the running (or last) session measured: its playhead reports, underruns and
// key-to-frame latencies. For tests and the bench; null before the first session.
export function liveStats() {
  return session ? session.liveStats() : null;
}

function sendControl(name, pressedAt) {
  if (!cameraOffered()) return null;
  const control = CAMERA_CONTROLS[name];
  const data = { translation: control.translation, rotation: control.rotation };
  return sendCamera({ mode: "velocity", data }, control.label, pressedAt);
}

// Typing goes to the field: letters and arrows there are text editing, not steering.
function isTextField(element) {
  if (!(element instanceof Element)) return false;
  if (element.isContentEditable || element.matches("textarea, select")) return true;
  return element.matches("input") &&
    !["checkbox", "radio", "button", "submit", "reset", "image", "color", "file"].includes(element.type);
}

function cameraButton(name) {
  return document.querySelector(`[data-camera="${name}"]`);
}

window.addEventListener("keydown", (event) => {
  const name = CAMERA_KEYS[event.code];
  if (!name || event.ctrlKey || event.metaKey || event.altKey || event.isComposing) return;
  if (!cameraOffered() || !session?.running || isTextField(event.target)) return;
  // The key is ours: no page scroll, no seek in a focused video.
  event.preventDefault();
  cameraButton(name)?.classList.add("pressed");
  // One press, one interaction: a held key's auto-repeat does not flood the server.
  if (event.repeat) return;
  sendControl(name, event.timeStamp);
});
window.addEventListener("keyup", (event) => {
  const name = CAMERA_KEYS[event.code];
  if (name) cameraButton(name)?.classList.remove("pressed");
});
window.addEventListener("blur", () => {
  for (const button of document.querySelectorAll("[data-camera].pressed")) button.classList.remove("pressed");
});
for (const button of document.querySelectorAll("[data-camera]")) {
  button.addEventListener("click", (event) => sendControl(button.dataset.camera, event.timeStamp));
}

function save() {
  if (!session || session.parts.length === 0) return;
  // The binary messages in order are one fragmented MP4 file; a viewer's too (its
  // first is the init segment and a keyframe chunk, wherever it joined).
  const blob = new Blob(session.parts, { type: "video/mp4" });
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${session.requestId ?? "trio_vstream"}.mp4`;
  document.body.append(link);
  link.click();
  link.remove();
  // Revoking at once can cancel the download in some browsers.
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}

async function loadDefaults() {
  try {
    const key = apiKey();
    const response = await fetch("/v1/models", { cache: "no-store", headers: authHeaders() });
    if (response.status === 401) {
      // A key that was refused is not kept: a reload would only be refused again.
      if (key) setApiKey(null);
      askForKey(Boolean(key));
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    if (key) {
      server.needsKey = true;
      keyAccepted();
    }
    const model = (await response.json()).data?.[0];
    if (!model) throw new Error("no model listed");
    const info = model.trio_vstream ?? {};
    server.model = model.id;
    server.engine = info.engine ?? null;
    server.endpoint = info.endpoint ?? DEFAULT_ENDPOINT;
    server.defaults = info.video_defaults ?? null;
    server.interactionKinds = Array.isArray(info.interaction_kinds) ? info.interaction_kinds : null;
    server.liveDefaults = liveDefaults(info.live_defaults);
    server.videoInput = info.video_input === true;
    const chunk = info.live_input_chunk_frames;
    server.liveInputChunkFrames = Number.isInteger(chunk) && chunk > 0 ? chunk : null;
    $("camera-in-row").hidden = !server.videoInput;
    showCameraControls();
    const d = server.defaults;
    // Once per page: a later reload of the defaults (after a key is entered or
    // forgotten) must not undo what the user typed meanwhile.
    const limits = info.limits;
    server.maxFrames = Number.isInteger(limits?.max_num_frames) && limits.max_num_frames > 0
      ? limits.max_num_frames : null;
    if (d && !server.formFilled) {
      server.formFilled = true;
      $("size").value = `${d.width}x${d.height}`;
      $("fps").value = d.fps;
      fillLength();
    }
    if (limits) {
      $("size-hint").textContent =
        `At most ${limits.max_width}×${limits.max_height} and ${limits.max_num_frames} frames.`;
    }
    $("model-info").textContent = `Model ${model.id}` + (server.engine ? ` (engine ${server.engine})` : "");
  } catch (error) {
    $("model-info").textContent = "Model: the server's default.";
    showError("defaults", `could not read /v1/models (${error.message}); empty fields get the engine's defaults`);
  } finally {
    // Settled: the defaults are in, or the page says why not, or it asks for a key.
    document.body.dataset.ready = "true";
  }
}

$("start-form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (!$("start").disabled) start();
});
// Enter in the prompt starts, as in a one-line field; Shift+Enter is a new line.
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("start-form").requestSubmit();
  }
});
for (const id of ["length", "length-unit"]) {
  $(id).addEventListener("input", () => { server.lengthEdited = true; });
}
$("live").addEventListener("change", fillLength);
$("stop").addEventListener("click", () => session?.stop());
$("save").addEventListener("click", save);
$("watch-save").addEventListener("click", save);
$("interact-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("interact-prompt").value;
  if (!session || session.closed || session.terminal || !prompt.trim()) return;
  const transition = numberField("transition");
  if (Number.isNaN(transition)) {
    showError("form", "Transition chunks is not a number");
    return;
  }
  session.interact(prompt, transition);
});
$("key-form").addEventListener("submit", (event) => {
  // Enter in the field submits too (the form's implicit submission).
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) {
    $("key-error").textContent = "Enter the API key.";
    $("api-key").focus();
    return;
  }
  setApiKey(key);
  $("key-error").textContent = "";
  $("model-info").textContent = "Checking the key…";
  if (watchPath) {
    keyAccepted();
    startWatching();
  } else {
    loadDefaults();
  }
});
$("key-forget").addEventListener("click", () => {
  setApiKey(null);
  $("key-state").hidden = true;
  // Asks again if the server needs a key (it answers 401 without one).
  loadDefaults();
});
$("share-copy").addEventListener("click", () => copyField("share-link", "share-copy"));
$("share-hls-copy").addEventListener("click", () => copyField("share-hls-url", "share-hls-copy"));
$("unmute")?.addEventListener("click", () => {
  $("video").muted = !$("video").muted;
  renderUnmute();
});
$("video").addEventListener("volumechange", () => $("unmute") && renderUnmute());
$("seed-use")?.addEventListener("click", () => {
  if (session?.seed != null) $("seed").value = String(session.seed);
});

if (watchPath) {
  // A share link: the token is the capability, so no /v1/models (which may need a key).
  startWatching();
  document.body.dataset.ready = "true";
} else {
  loadDefaults();
}
