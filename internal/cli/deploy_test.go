package cli

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// TestKubernetesExample: deploy/kubernetes/idem-sidecar.yaml configures a
// proxy that starts (its file and flags are valid), and its ports, probes
// and grace period agree with that configuration.
func TestKubernetesExample(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "kubernetes", "idem-sidecar.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	type probe struct {
		HTTPGet struct{ Path, Port string } `yaml:"httpGet"`
	}
	type container struct {
		Name  string
		Args  []string
		Ports []struct {
			Name          string
			ContainerPort int `yaml:"containerPort"`
		}
		VolumeMounts []struct {
			MountPath string `yaml:"mountPath"`
			ReadOnly  bool   `yaml:"readOnly"`
		} `yaml:"volumeMounts"`
		SecurityContext struct {
			ReadOnlyRoot bool `yaml:"readOnlyRootFilesystem"`
		} `yaml:"securityContext"`
		Readiness probe `yaml:"readinessProbe"`
		Liveness  probe `yaml:"livenessProbe"`
		Lifecycle struct {
			PreStop struct {
				Sleep struct{ Seconds int }
			} `yaml:"preStop"`
		}
	}
	var (
		config string
		grace  int
		idem   []container
		others []container // beside idem in its pod: the API
	)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var doc struct {
			Kind string
			Data map[string]string
			Spec struct {
				Template struct {
					Spec struct {
						Grace      int `yaml:"terminationGracePeriodSeconds"`
						Containers []container
					}
				}
			}
		}
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if doc.Kind == "ConfigMap" {
			config = doc.Data["idem.yaml"]
		}
		for _, c := range doc.Spec.Template.Spec.Containers {
			if c.Name == "idem" {
				idem, grace = append(idem, c), doc.Spec.Template.Spec.Grace
				others = slices.DeleteFunc(slices.Clone(doc.Spec.Template.Spec.Containers), func(c container) bool { return c.Name == "idem" })
			}
		}
	}
	if config == "" || len(idem) != 1 || len(idem[0].Args) < 1 || idem[0].Args[0] != "proxy" {
		t.Fatalf("want an idem.yaml (%d bytes) and one idem container running the proxy (%+v)", len(config), idem)
	}
	c := idem[0]
	if c.Readiness.HTTPGet != (struct{ Path, Port string }{"/readyz", "admin"}) || c.Liveness.HTTPGet != (struct{ Path, Port string }{"/healthz", "admin"}) {
		t.Errorf("the idem container's probes: %+v %+v", c.Readiness, c.Liveness)
	}
	path := filepath.Join(t.TempDir(), "idem.yaml")
	os.WriteFile(path, []byte(config), 0o600)
	args := slices.Clone(c.Args[1:])
	if i := slices.Index(args, "/etc/idem/idem.yaml"); i >= 0 {
		args[i] = path
	}
	// The container runs the image, with its environment, and the
	// example's own variables.
	env := imageEnv(t)
	env["IDEM_STORE"] = "postgres://idem@postgres:5432/payments"
	cfg, _, err := loadProxyConfig(args, envOf(env), io.Discard, io.Discard)
	if err != nil {
		t.Fatalf("the example's configuration: %v", err)
	}
	// The journal keeps outcomes the store has not taken yet: it must be
	// on a writable volume of the container (the root is read-only, and a
	// restarted container starts from the image's).
	onVolume := false
	for _, m := range c.VolumeMounts {
		onVolume = onVolume || (!m.ReadOnly && strings.HasPrefix(cfg.JournalDir(), strings.TrimSuffix(m.MountPath, "/")+"/"))
	}
	if !onVolume || !c.SecurityContext.ReadOnlyRoot {
		t.Errorf("the journal is in %s, on no writable volume of the container (%+v; read-only root %v)", cfg.JournalDir(), c.VolumeMounts, c.SecurityContext.ReadOnlyRoot)
	}
	ports := map[string]string{}
	for _, p := range c.Ports {
		ports[p.Name] = strconv.Itoa(p.ContainerPort)
	}
	for name, addr := range map[string]string{"http": cfg.Listen, "admin": cfg.AdminListen} {
		if _, port, _ := net.SplitHostPort(addr); port != ports[name] {
			t.Errorf("port %s is %q; the configuration listens on %s", name, ports[name], addr)
		}
	}
	// The proxy stops accepting at SIGTERM: the Service must have dropped
	// the pod by then (a preStop sleep), and the grace period must hold the
	// sleep and the whole shutdown.
	sleep := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	if sleep <= 0 {
		t.Errorf("the idem container has no preStop sleep: connections are refused while endpoints update")
	}
	if time.Duration(grace)*time.Second <= sleep+cfg.ShutdownTimeout {
		t.Errorf("terminationGracePeriodSeconds %d is not above the preStop sleep %v plus shutdown_timeout %v", grace, sleep, cfg.ShutdownTimeout)
	}
	// Kubernetes sends SIGTERM to every container of the pod at once: the
	// API must serve the requests the proxy finishes meanwhile.
	for _, api := range others {
		if apiSleep := time.Duration(api.Lifecycle.PreStop.Sleep.Seconds) * time.Second; apiSleep < sleep+cfg.ShutdownTimeout {
			t.Errorf("the %s container stops after a preStop sleep of %v, before idem has drained (%v and shutdown_timeout %v): requests in flight end UNKNOWN",
				api.Name, apiSleep, sleep, cfg.ShutdownTimeout)
		}
	}
}

// imageEnv is the IDEM_ variables the Dockerfile's image sets.
func imageEnv(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, v := range regexp.MustCompile(`\b(IDEM_[A-Z_]+)=(\S+)`).FindAllStringSubmatch(string(data), -1) {
		env[v[1]] = v[2]
	}
	return env
}

// TestImageLeavesTheFileItsSettings: a configuration file given to the
// image keeps its store and journal: the image's environment, which beats
// a file, sets neither (it set both, and a file's postgres:// store was
// replaced by the image's SQLite without a word: no idempotency across
// replicas). What the image sets and a file says otherwise is told at
// start, even where the file says what the default is (a sidecar that
// keeps to its pod's loopback, opened to the network by the image).
func TestImageLeavesTheFileItsSettings(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.yaml")
	file := "upstream: http://127.0.0.1:9000\nstore: postgres://idem@db:5432/payments\njournal_dir: /var/lib/idem/journal\nlisten: 127.0.0.1:8080\n"
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cfg, _, err := loadProxyConfig([]string{"--config", path}, envOf(imageEnv(t)), io.Discard, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Store != "postgres://idem@db:5432/payments" || cfg.JournalDir() != "/var/lib/idem/journal" {
		t.Errorf("under the image's environment, the file's store is %q and journal %q", cfg.Store, cfg.JournalDir())
	}
	if cfg.Listen != imageEnv(t)["IDEM_LISTEN"] || !strings.Contains(stderr.String(), "IDEM_LISTEN") || !strings.Contains(stderr.String(), "listen") {
		t.Errorf("listen %s; the start said %q, want a word that $IDEM_LISTEN replaced the file's listen", cfg.Listen, stderr.String())
	}
}

// TestDockerfileSettings: the variables the image sets are settings.
func TestDockerfileSettings(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("..", "..", "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, s := range proxySettings() {
		known[s.env] = true
	}
	vars := regexp.MustCompile(`\b(IDEM_[A-Z_]+)=`).FindAllStringSubmatch(string(data), -1)
	if len(vars) == 0 {
		t.Fatal("the Dockerfile sets no IDEM_ variable")
	}
	for _, v := range vars {
		if !known[v[1]] {
			t.Errorf("the Dockerfile sets %s, which is not a setting", v[1])
		}
	}
	var stdout, stderr strings.Builder
	if code := Main(context.Background(), []string{"help"}, envOf(nil), &stdout, &stderr); code != 0 {
		t.Fatalf("idem help (the image's default command): %d %s", code, stderr.String())
	}
}
