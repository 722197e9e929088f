package console

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"
)

// Entry is one line of the audit log: an action an operator asked for, and
// what it did.
type Entry struct {
	// At is when the action ran.
	At time.Time `json:"at"`
	// Who is the operator's name, as typed, and From the address the
	// request came from.
	Who  string `json:"who"`
	From string `json:"from"`
	// Action is resolve_completed, resolve_failed, release or purge.
	Action string `json:"action"`
	// Scope and KeyHash name the record (idem.KeyHash; never the key
	// itself, which is a secret of the caller's). Empty for a purge.
	Scope   string `json:"scope,omitempty"`
	KeyHash string `json:"key_hash,omitempty"`
	// Before and After describe the record (state, fence, status) or, for
	// a purge, the records deleted.
	Before string `json:"before"`
	After  string `json:"after"`
	// Error is why the action failed; empty when it succeeded.
	Error string `json:"error,omitempty"`
}

// Audit is the audit log: every action, appended to a file as a line of
// JSON (synced before the action is reported done), and the latest kept in
// memory for the console to show. With no file it is kept in memory only.
type Audit struct {
	mu         sync.Mutex
	path       string
	recent     []Entry
	unreadable []int
	// torn is set while the file may end in a line cut short (an append
	// that a crash or a full disk interrupted): the next one starts a new
	// line, so that it is read whole.
	torn bool
}

// keep is how many entries the console shows.
const keep = 200

// OpenAudit opens the audit log at path and reads the entries it already
// holds; an empty path keeps the log in memory only. For a console that
// acts (write), the file is created if need be, and one that cannot be
// appended to is refused, so that no action runs unaudited; for a
// read-only console, a file that does not exist is an empty log. A line
// that does not parse (an append that a crash or a full disk cut short) is
// left as it is and passed over: see [Audit.Unreadable].
func OpenAudit(path string, write bool) (*Audit, error) {
	a := &Audit{path: path}
	if path == "" {
		return a, nil
	}
	var f *os.File
	var err error
	if write {
		f, err = os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE, 0o600)
	} else if f, err = os.Open(path); os.IsNotExist(err) {
		return a, nil
	}
	if err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var e Entry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			a.unreadable = append(a.unreadable, n)
			continue
		}
		a.remember(e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	last := make([]byte, 1)
	if info, err := f.Stat(); err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	} else if info.Size() > 0 {
		if _, err := f.ReadAt(last, info.Size()-1); err != nil {
			return nil, fmt.Errorf("audit log: %w", err)
		}
		a.torn = last[0] != '\n'
	}
	return a, nil
}

// Unreadable returns the numbers of the lines of the file that did not
// parse when it was opened (an append cut short), for the operator to look
// at; their entries are not in [Audit.Recent].
func (a *Audit) Unreadable() []int { return a.unreadable }

// Path is the file the log is written to; empty when it is in memory only.
func (a *Audit) Path() string { return a.path }

// Write appends e to the log; the action it describes is not reported done
// unless Write succeeds.
func (a *Audit) Write(e Entry) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.path != "" {
		line, err := json.Marshal(e)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(a.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			return fmt.Errorf("audit log: %w", err)
		}
		if a.torn {
			line = append([]byte{'\n'}, line...)
		}
		_, err = f.Write(append(line, '\n'))
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			a.torn = true // some of the line may have been written
			return fmt.Errorf("audit log: %w", err)
		}
		a.torn = false
	}
	a.remember(e)
	return nil
}

func (a *Audit) remember(e Entry) {
	a.recent = append(a.recent, e)
	if len(a.recent) > keep {
		a.recent = slices.Delete(a.recent, 0, len(a.recent)-keep)
	}
}

// Recent returns the latest entries, newest first.
func (a *Audit) Recent() []Entry {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := slices.Clone(a.recent)
	slices.Reverse(out)
	return out
}
