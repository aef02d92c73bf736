package envd

import (
	"bytes"
	"os"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
)

// TestPumpReadsWhatThePipeHoldsAfterTheDrainDeadline: a process that wrote
// its output and exited, and a pump that came back to the pipe only after
// the drain deadline had passed (a slow subscriber, a loaded guest: seen
// as commands answering "" with exit 0 under 32 concurrent streams). The
// output in the pipe still reaches the subscriber.
func TestPumpReadsWhatThePipeHoldsAfterTheDrainDeadline(t *testing.T) {
	for _, size := range []int{len("stream-7\n"), readChunk + 100, 60 << 10} {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		want := bytes.Repeat([]byte("x"), size)
		copy(want, "stream-7\n")
		if _, err := w.Write(want); err != nil {
			t.Fatal(err)
		}
		w.Close()
		// The writer is gone but a leftover child could still hold the
		// write end: only the deadline ends the pump. Here it has passed.
		p := &proc{subs: map[*subscriber]struct{}{}}
		p.exited.Store(true)
		if err := r.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
			t.Fatal(err)
		}
		sub, _ := p.subscribe()
		done := make(chan struct{})
		go func() { p.pump(r, 0); close(done) }()
		var got []byte
		for collecting := true; collecting; {
			select {
			case ev := <-sub.ch:
				got = append(got, ev.GetEvent().(*processpb.ProcessEvent_Data).Data.GetStdout()...)
			case <-done:
				for len(sub.ch) > 0 {
					ev := <-sub.ch
					got = append(got, ev.GetEvent().(*processpb.ProcessEvent_Data).Data.GetStdout()...)
				}
				collecting = false
			case <-time.After(10 * time.Second):
				t.Fatal("pump did not return")
			}
		}
		r.Close()
		if !bytes.Equal(got, want) {
			t.Errorf("%d bytes in the pipe: the subscriber got %d", size, len(got))
		}
	}
}

// TestPumpStopsWhenALeftoverChildKeepsTheWriteEnd: the drain after the
// deadline reads what is there, and returns on an empty pipe whose write
// end is still open rather than waiting for it.
func TestPumpStopsWhenALeftoverChildKeepsTheWriteEnd(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	w.Write([]byte("last words\n"))
	p := &proc{subs: map[*subscriber]struct{}{}}
	p.exited.Store(true)
	r.SetReadDeadline(time.Now().Add(outputDrainAfterExitFor))
	sub, _ := p.subscribe()
	done := make(chan struct{})
	go func() { p.pump(r, 1); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("pump waits on a write end that stays open")
	}
	if len(sub.ch) != 1 {
		t.Fatalf("%d events, want the one chunk", len(sub.ch))
	}
	if got := string((<-sub.ch).GetEvent().(*processpb.ProcessEvent_Data).Data.GetStderr()); got != "last words\n" {
		t.Fatalf("stderr %q", got)
	}
}
