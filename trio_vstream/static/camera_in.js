// Camera in: the person's camera as the session's input video (`input_video`, this
// server's extension; docs/protocol.md "Video in"). The camera is drawn to a canvas at
// the session's size, sent as one JPEG per binary WebSocket message at the session's
// input rate, and shown beside the output. Apart from player.js because none of it is
// needed unless the engine takes video input.

// At most this many seconds of frames ahead of the last one a chunk was made from: the
// server keeps about two seconds, so a camera faster than the engine never loses frames
// to its buffer; the page skips a capture instead (a live camera has a newer one soon).
const AHEAD_SECONDS = 1;
// JPEG quality: a 256x256 frame is a few KB, far under the server's 1 MiB cap.
const QUALITY = 0.8;
// The most latencies kept for the figures (the same window as the key's).
const WINDOW = 50;

export class CameraIn {
  // Ask for the camera first, before the session starts: a refusal (or no camera)
  // is an error the person sees, and no session is started for nothing.
  static async open(width, height) {
    if (!navigator.mediaDevices?.getUserMedia) throw new Error("this browser gives no camera to pages (HTTPS or localhost only)");
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: false,
      video: { width: { ideal: width }, height: { ideal: height } },
    });
    return new CameraIn(stream, width, height);
  }

  constructor(stream, width, height) {
    this.stream = stream;
    this.width = width;
    this.height = height;
    this.fps = 24;
    this.view = document.getElementById("camera-view");
    this.view.srcObject = stream;
    this.view.hidden = false;
    this.view.play().catch(() => {});
    this.canvas = document.createElement("canvas");
    this.canvas.width = width;
    this.canvas.height = height;
    this.context = this.canvas.getContext("2d");
    this.ws = null;
    this.timer = null;
    this.encoding = false;
    this.sent = 0;            // frames sent: the next one's index on the server
    this.acked = -1;          // the input frame the newest chunk's last output frame shows
    this.skipped = 0;         // captures not sent (ahead of the engine, or still encoding)
    this.captures = new Map(); // index -> when it was drawn (performance.now())
    this.awaiting = [];       // [media time of a chunk's last frame, its input index]
    this.latencies = [];      // ms: an input frame drawn -> the output frame showing it presented
    this.parts = [];          // ms: [drawn -> its chunk arrived, arrived -> presented]
    this.measured = 0;        // latencies measured in all (the lists keep the last WINDOW)
    this.counts = { used: 0, dropped: 0, reused: 0 };
  }

  // What session.start says of the input: the session's size, JPEG, at `fps`.
  request(fps) {
    this.fps = Math.max(1, Math.min(60, Math.round(fps)));
    return { frame_format: "jpeg", fps: this.fps, width: this.width, height: this.height };
  }

  // From video.start on: a capture every frame interval, on a clock that does not drift.
  // The server makes output from input frame by frame, and the output plays at the
  // session's rate on this page's clock, so input sent any faster waits on the server for
  // good: setInterval(f, 1000 / 24) fires every 41 ms (24.4 a second), and the wait grew
  // by 12 ms every second (measured: drawn -> chunk arrived from 150 to 400 ms in 20 s).
  // Capture n is due n frame intervals after the first; a tick that comes more than an
  // interval late skips the captures it missed rather than send them in a burst.
  start(ws) {
    this.ws = ws;
    this.clockStart = performance.now();
    this.ticks = 0;
    this.tick();
  }

  tick() {
    this.capture();
    const interval = 1000 / this.fps;
    const now = performance.now();
    this.ticks = Math.max(this.ticks + 1, Math.ceil((now - this.clockStart) / interval));
    this.timer = setTimeout(() => this.tick(), this.clockStart + this.ticks * interval - now);
  }

  capture() {
    const ws = this.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN) return;
    if (this.encoding || this.sent - 1 - this.acked > AHEAD_SECONDS * this.fps) {
      this.skipped += 1;
      return;
    }
    const video = this.view;
    if (video.readyState < 2 || !video.videoWidth) return; // no camera picture yet
    // Cover the session's frame: the camera's picture scaled and cropped to its aspect.
    const scale = Math.max(this.width / video.videoWidth, this.height / video.videoHeight);
    const w = video.videoWidth * scale;
    const h = video.videoHeight * scale;
    this.context.drawImage(video, (this.width - w) / 2, (this.height - h) / 2, w, h);
    const drawnAt = performance.now();
    // One encode at a time, so frames leave in the order they were drawn.
    this.encoding = true;
    this.canvas.toBlob((blob) => {
      this.encoding = false;
      if (!blob || this.ws !== ws || ws.readyState !== WebSocket.OPEN) return;
      this.captures.set(this.sent, drawnAt);
      this.sent += 1;
      ws.send(blob);
    }, "image/jpeg", QUALITY);
  }

  // A chunk's video.chunk_metadata: which input its frames show. `startFrame` is the
  // chunk's first frame in the output (its media time is startFrame / fps).
  onChunk(meta, startFrame, outputFps, arrivedAt) {
    const input = meta.input_frames;
    if (!input) return;
    this.counts.used += input.used;
    this.counts.dropped += input.dropped;
    this.counts.reused += input.reused;
    if (!Number.isInteger(input.last)) return;
    this.acked = Math.max(this.acked, input.last);
    const last = (startFrame + meta.num_frames - 1) / outputFps;
    this.awaiting.push({ mediaTime: last, index: input.last, arrivedAt });
    this.forget();
  }

  // Captures no chunk can show any more are forgotten: those before the input of the
  // oldest chunk whose last frame is still to be presented. Not those before the newest
  // chunk's: at 24 fps the next chunk arrives before this one's last frame is on screen
  // (a chunk plays for its whole length after it arrives), and its capture is still needed.
  forget() {
    const oldest = this.awaiting.length > 0
      ? Math.min(...this.awaiting.map((record) => record.index))
      : this.acked + 1;
    for (const index of this.captures.keys()) {
      if (index < oldest) this.captures.delete(index);
    }
  }

  // An output frame presented: latencies for the chunks whose last frame it is (or passed).
  frameShown(mediaTime, when, slack) {
    if (this.awaiting.length === 0) return;
    const shown = this.awaiting.filter((record) => mediaTime >= record.mediaTime - slack);
    if (shown.length === 0) return;
    this.awaiting = this.awaiting.filter((record) => !shown.includes(record));
    for (const record of shown) {
      const drawnAt = this.captures.get(record.index);
      if (drawnAt == null) continue;
      this.latencies.push(when - drawnAt);
      this.measured += 1;
      this.parts.push([record.arrivedAt - drawnAt, when - record.arrivedAt]);
      if (this.latencies.length > WINDOW) this.latencies.shift();
      if (this.parts.length > WINDOW) this.parts.shift();
    }
    this.forget();
  }

  // What the page measured, for the figures, tests and the bench (copies).
  stats() {
    return {
      sent: this.sent,
      skipped: this.skipped,
      acked: this.acked,
      measured: this.measured,
      counts: { ...this.counts },
      latencies: [...this.latencies],
      parts: this.parts.map((pair) => [...pair]),
    };
  }

  // The session ended or was left: no more captures, and the camera is let go.
  stop() {
    clearTimeout(this.timer);
    this.timer = null;
    this.ws = null;
    for (const track of this.stream.getTracks()) track.stop();
    this.view.srcObject = null;
    this.view.hidden = true;
  }
}
